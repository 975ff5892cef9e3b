"""OpenAI chat completions to the protocol-neutral turn, and results back.

Decisions worth knowing:

* ``temperature`` or ``top_p`` absent take the model's defaults (its
  generation_config.json, else the documented fallback; see
  engine/models/sampling_defaults.py), not OpenAI's 1.0: small local models
  drift into nonsense at 1 and loop at 0. Send ``temperature: 0`` for
  reproducible greedy output.
* ``developer`` messages are system messages (OpenAI renamed the role for
  reasoning models; chat templates only know ``system``).
* ``image_url`` parts (data URLs; web URLs only where the server allows
  fetching them) go to a vision model as images; a model without vision
  refuses them unless the server allows a placeholder (turns.py). Audio and
  file parts become short placeholders: dropping them silently would change
  what the user meant.
* A thinking model's reasoning comes back as ``reasoning_content`` (the name
  DeepSeek, llama.cpp, LM Studio and SGLang use) and as ``reasoning`` (mlx-lm's
  and vLLM's), in the message and in stream deltas; either is read back from
  an assistant message. ``reasoning_effort`` sets its budget (``none``: off)
  and ``chat_template_kwargs`` goes to the template (reasoning_ask.py).
* ``tool_choice: "required"`` and a named tool are passed on as the neutral
  ``any``/name (a local model cannot be forced to call); with ``none`` the
  output is not parsed for tool calls, and the renderer decides whether the
  tool listing stays in the prompt.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Mapping

from engine.errors import InvalidRequestError
from engine.domain.requests import FinishEvent, Usage
from engine.settings import Settings

from engine.domain.chat import ChatMessage, Conversation, ImagePart, Part, ToolCall, ToolSpec
from .identity import openai_identity, with_client_hints
from .request_priority import asked_priority
from .image_inputs import from_url, image_text
from .openai_schemas import ChatCompletionRequest, ContentPart, MessageIn, NamedToolChoice, ToolCallIn
from .output_formats import openai_response_format
from .reasoning_ask import ReasoningAsk, openai_reasoning
from .turns import SamplingAsked, TurnSpec, ended_by

FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_use": "tool_calls"}


@dataclass(frozen=True, slots=True)
class CompletionMeta:
    """What every response and chunk of one completion repeats."""

    id: str
    created: int
    model: str
    agent_id: str

    @classmethod
    def new(cls, model: str, agent_id: str, id_prefix: str = "chatcmpl") -> "CompletionMeta":
        return cls(f"{id_prefix}-{secrets.token_hex(12)}", int(time.time()), model, agent_id)


# -- request ----------------------------------------------------------------------------------
def to_turn_spec(body: ChatCompletionRequest, headers: Mapping[str, str], settings: Settings) -> TurnSpec:
    max_tokens = body.max_completion_tokens or body.max_tokens or settings.default_max_tokens
    reasoning = openai_reasoning(body.reasoning_effort, body.chat_template_kwargs, max_tokens)
    conversation = to_conversation(body, reasoning)
    identity = with_client_hints(openai_identity(headers, body.session_id, conversation), headers)
    return TurnSpec(conversation, identity, max_tokens, sampling_of(body), stops_of(body.stop), model=body.model,
                    output_format=openai_response_format(body.response_format), reasoning=reasoning,
                    priority=asked_priority(body.priority, "priority", headers))


def to_conversation(body: ChatCompletionRequest, reasoning: ReasoningAsk) -> Conversation:
    tools = tuple(ToolSpec(t.function.name, t.function.description, t.function.parameters, bool(t.function.strict))
                  for t in body.tools or ())
    return Conversation(tuple(_messages(body.messages)), tools, _tool_choice(body.tool_choice, tools),
                        body.parallel_tool_calls is not False, template_kwargs=reasoning.kwargs())


def sampling_of(body: ChatCompletionRequest) -> SamplingAsked:
    return SamplingAsked(
        temperature=body.temperature,
        top_p=body.top_p,
        # OpenAI takes any integer; MLX PRNG keys take only unsigned 64-bit ones.
        seed=body.seed % 2**64 if body.seed is not None else None,
    )


def stops_of(stop: str | list[str] | None) -> tuple[str, ...]:
    values = [stop] if isinstance(stop, str) else (stop or [])
    return tuple(s for s in values if s)


def _messages(messages: list[MessageIn]) -> Iterator[ChatMessage]:
    # Tool results name only the call id; chat templates want the function name too.
    names: dict[str, str] = {}
    for index, message in enumerate(messages):
        text, parts = content_parts(message.content, f"messages.{index}.content")
        if message.role == "tool":
            name = message.name or names.get(message.tool_call_id or "")
            yield ChatMessage("tool", text, tool_call_id=message.tool_call_id, name=name, parts=parts)
            continue
        calls = tuple(_tool_call(c, f"messages.{index}.tool_calls.{j}") for j, c in enumerate(message.tool_calls or ()))
        names.update((c.id, c.name) for c in calls)
        role = "system" if message.role == "developer" else message.role
        if role != "assistant":
            yield ChatMessage(role, text, parts=parts)
            continue
        yield ChatMessage(role, text, tool_calls=calls, reasoning=message.reasoning_content or message.reasoning or "")


def content_text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(_part_text(part) for part in content)


def content_parts(content: str | list[ContentPart] | None, field: str) -> tuple[str, tuple[Part, ...]]:
    """A message's text, and its parts in order when it holds images (``image_url`` parts)."""
    if not isinstance(content, list) or not any(part.type == "image_url" for part in content):
        return content_text(content), ()
    parts: list[Part] = []
    for at, part in enumerate(content):
        parts.append(_image(part, f"{field}.{at}") if part.type == "image_url" else _part_text(part))
    return image_text(parts, "\n")


def _image(part: ContentPart, field: str) -> ImagePart:
    url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{field}.image_url.url: an image_url part needs a url", field=f"{field}.image_url.url")
    return from_url(url, f"{field}.image_url.url")


def _part_text(part: ContentPart) -> str:
    if part.type in ("text", "input_text"):
        return part.text or ""
    if part.type in ("image_url", "input_image", "image"):
        return "[image]"
    return f"[{part.type}]"


def _tool_call(call: ToolCallIn, field: str) -> ToolCall:
    raw = call.function.arguments.strip()
    try:
        arguments = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise InvalidRequestError(f"{field}.function.arguments is not valid JSON: {exc}", field=field) from exc
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{field}.function.arguments must encode a JSON object", field=field)
    return ToolCall(call.id, call.function.name, arguments)


def _tool_choice(choice: str | NamedToolChoice | None, tools: tuple[ToolSpec, ...]) -> str:
    if choice is None or choice == "auto":
        return "auto"
    if choice == "none":
        return "none"
    if not tools:
        raise InvalidRequestError("tool_choice requires tools to be specified", field="tool_choice")
    if choice == "required":
        return "any"
    assert isinstance(choice, NamedToolChoice)
    if choice.function.name not in {t.name for t in tools}:
        raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                  field="tool_choice")
    return choice.function.name


# -- response ---------------------------------------------------------------------------------
def finish_reason(finish: FinishEvent, calls: list[ToolCall]) -> str:
    return FINISH_REASONS.get(ended_by(finish, bool(calls)), "stop")


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.generated_tokens,
        "total_tokens": usage.prompt_tokens + usage.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.reused_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "semantic": cache_usage(usage),
    }


def cache_usage(usage: Usage) -> dict[str, Any]:
    """The ``semantic`` usage extension: where the reused tokens came from and what the hand-off cost."""
    return {
        "reuse_source": usage.reuse_source,
        "reuse_note": usage.reuse_note,
        "handoff_in_ms": round(usage.handoff_in_s * 1000, 3),
        "handoff_out_ms": round(usage.handoff_out_s * 1000, 3),
        "copied_bytes": usage.copied_bytes,
        "cache_outcome": usage.cache_outcome,
        "diverged_at": usage.diverged_at,
        "speculation": asdict(usage.speculation) if usage.speculation is not None else None,
        "loop_closed": asdict(usage.loop_closed) if usage.loop_closed is not None else None,
        "model": usage.model,  # the weights that served it (x-semantic-model says the same)
    }


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def completion_body(meta: CompletionMeta, text: str, calls: list[ToolCall], finish: FinishEvent,
                    reasoning: str = "") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [tool_call_body(c) for c in calls]
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(finish, calls)}],
        "usage": usage_body(finish.usage),
        "agent_id": meta.agent_id,
    }
