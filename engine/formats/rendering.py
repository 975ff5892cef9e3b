"""Conversations to prompt tokens through the model's own chat template.

Three paths, chosen per model:

* template with tool support (mlx-lm found a tool parser for it): messages,
  tool calls and tool results go to the template in the OpenAI shape it expects;
* template without tool support (SmolLM2's ChatML): tool definitions are added
  to the system message in the Hermes format, calls are rendered as
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` and results as
  ``<tool_response>...</tool_response>`` user turns — the one documented
  fallback, parsed back by ``tool_calls.FALLBACK``;
* no template at all (base models such as Gemma 3 270M): plain
  ``System:`` / ``User:`` / ``Assistant:`` paragraphs. A base model continues
  such a transcript with the next speaker's paragraph (measured on Gemma 3
  270M: "User: Name two colours.", then a made-up reply, until the output cap),
  so a paragraph opening with a speaker marker ends the reply
  (``turn_end_strings``).

Rendering is deterministic (JSON with sorted keys), so the same history always
yields the same tokens and the agent's cached prefix keeps matching.

An assistant turn's reasoning goes to the template under the names templates
read (``reasoning_content``: Qwen3, GLM, Kimi, Gemma 4; ``thinking``:
gpt-oss); the template decides whether it renders (Qwen3's render it only
after the last user query). The conversation's template keyword arguments
(``enable_thinking``, a client's ``chat_template_kwargs``) go with every call.
gpt-oss's template, which reads tools and tool calls itself, is given them
natively although mlx-lm finds no tool parser for it.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError

from engine.domain.chat import ChatMessage, Conversation, ToolSpec
from engine.domain.reasoning import HarmonyFormat
from engine.models.reasoning_format import reasoning_format

FALLBACK_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


# The speakers of the plain format; a new paragraph opening with one ends the reply.
PLAIN_SPEAKERS = ("User", "Assistant", "System")


class PromptRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))
        self.native_tools = (bool(getattr(tokenizer, "has_tool_calling", False))
                             or isinstance(reasoning_format(tokenizer), HarmonyFormat))

    @property
    def turn_end_strings(self) -> tuple[str, ...]:
        """Text that starts another speaker's turn in the plain format; none under a chat template
        (the template's own end-of-turn token is an EOS id there)."""
        return () if self.has_template else tuple(f"\n\n{speaker}:" for speaker in PLAIN_SPEAKERS)

    def render(self, conversation: Conversation) -> list[int]:
        if not self.has_template:
            return self._plain(conversation)
        return self._templated(conversation, tokenize=True)

    def render_text(self, conversation: Conversation) -> str:
        """The prompt as text, before tokenization (a vision model's processor tokenizes it with its images)."""
        if not self.has_template:
            raise ValueError("a prompt without a chat template is rendered as tokens only")
        return self._templated(conversation, tokenize=False)

    def _templated(self, conversation: Conversation, tokenize: bool) -> Any:
        messages = self._template_messages(conversation)
        tools = [_tool_schema(t) for t in conversation.tools] if self.native_tools and conversation.tools else None
        kwargs = dict(conversation.template_kwargs)
        try:
            return self._apply(messages, tools, kwargs, tokenize)
        except TemplateError:
            # Strict templates reject system turns mid-conversation or two turns of one role in a row (fold them
            # into alternating turns), and gpt-oss's a call's reasoning beside its preamble text (keep the text).
            return self._apply(_alternating(_calls_without_reasoning(messages)), tools, kwargs, tokenize)

    def render_head(self, head: Conversation) -> list[int]:
        """A conversation's head (system messages and tools) on its own; [] when the template cannot render it
        alone (a template that writes tools into a system turn refuses a conversation with no message)."""
        if not head.messages and self.native_tools:
            return []
        try:
            return self.render(head)
        except (TemplateError, ValueError):
            return []

    def continuation(self, messages: tuple[ChatMessage, ...]) -> list[int]:
        """``messages`` (user first) as the template renders them after a finished assistant turn.

        For a fork of another client's agent: its cache ends after a reply, and what follows
        must look as the template would put it there. Rendered as the tail of a conversation
        with one placeholder exchange before it: what the template adds after that exchange.
        A template that renders the exchange differently once more follows (some strip earlier
        replies) gives no clean tail; then the messages are rendered on their own.
        """
        head = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        if not self.has_template:
            # The tail of a token sequence already in a cache: no BOS in front of it.
            text = "".join(f"\n\n{_paragraph(m.role, m.content)}" for m in messages)
            return list(self.tokenizer.encode(text + "\n\nAssistant:", add_special_tokens=False))
        before = list(self.tokenizer.apply_chat_template(head, add_generation_prompt=False))
        whole = self._apply(head + [_fallback(m) for m in messages], None, {})
        if whole[:len(before)] == before:
            return whole[len(before):]
        return self.render(Conversation(tuple(messages)))

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               template_kwargs: dict[str, Any], tokenize: bool = True) -> Any:
        kwargs: dict[str, Any] = {**template_kwargs, "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        if not tokenize:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return list(self.tokenizer.apply_chat_template(messages, **kwargs))

    def _template_messages(self, conversation: Conversation) -> list[dict[str, Any]]:
        if self.native_tools:
            return [_native(m) for m in conversation.messages]
        messages = [_fallback(m) for m in conversation.messages]
        if conversation.tools and conversation.tool_choice != "none":
            messages = _with_tool_prompt(messages, conversation.tools)
        return _merge_adjacent_tool_results(messages)

    def _plain(self, conversation: Conversation) -> list[int]:
        parts = []
        tools = conversation.tools if conversation.tool_choice != "none" else ()
        for message in _with_tool_prompt([_fallback(m) for m in conversation.messages], tools):
            parts.append(_paragraph(message["role"], message["content"]))
        parts.append("Assistant:")
        return list(self.tokenizer.encode("\n\n".join(parts)))


def _paragraph(role: str, content: str) -> str:
    # "Assistant:" ends the generation prompt, so a reply starts with its own space (" The
    # capital..."); one space, not two, keeps the next turn's rendering equal to the tokens cached.
    return f"{role.capitalize()}:{content if content[:1].isspace() else ' ' + content}"


def _tool_schema(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def _with_reasoning(out: dict[str, Any], message: ChatMessage) -> dict[str, Any]:
    if message.reasoning:
        out["reasoning_content"] = out["thinking"] = message.reasoning
    return out


def _calls_without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k not in ("reasoning_content", "thinking")}
            if m.get("tool_calls") and m.get("content") else m for m in messages]


def _native(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = _with_reasoning({"role": message.role, "content": message.content}, message)
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out


def _fallback(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.content}\n</tool_response>", "_tool_result": True}
    content = message.content
    for call in message.tool_calls:
        rendered = dumps({"name": call.name, "arguments": call.arguments})
        content = f"{content}\n<tool_call>\n{rendered}\n</tool_call>" if content else f"<tool_call>\n{rendered}\n</tool_call>"
    return _with_reasoning({"role": message.role, "content": content}, message)


def _with_tool_prompt(messages: list[dict[str, Any]], tools: tuple[ToolSpec, ...]) -> list[dict[str, Any]]:
    if not tools:
        return messages
    listing = "\n".join(dumps(_tool_schema(t)) for t in tools)
    prompt = FALLBACK_TOOL_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _merge_adjacent_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several tool results in a row become one user turn, as one tool_result list is."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        if merged and message.get("_tool_result") and merged[-1].get("_tool_result"):
            merged[-1] = dict(merged[-1], content=f"{merged[-1]['content']}\n{message['content']}")
        else:
            merged.append(message)
    return [{k: v for k, v in m.items() if not k.startswith("_")} for m in merged]


def _alternating(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message["role"]
        content = message.get("content", "")
        if role == "system" and index > 0:
            role, content = "user", f"[system]\n{content}"
        if out and out[-1]["role"] == role:
            out[-1] = dict(out[-1], content=f"{out[-1]['content']}\n\n{content}")
        else:
            out.append(dict(message, role=role, content=content))
    return out
