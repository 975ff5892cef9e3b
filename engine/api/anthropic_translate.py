"""Anthropic request bodies to the protocol-neutral Conversation and TurnSpec.

Decisions that differ from Anthropic's hosted API, on purpose:

* An absent ``temperature`` (or ``top_p``/``top_k``) takes the model's
  default (its generation_config.json, else the documented fallback; see
  engine/models/sampling_defaults.py), not Anthropic's 1.0: Claude Code sends
  no temperature, small local models produce noise at 1.0 and loop at 0.
  Explicit values are honoured; ``top_p: 0`` means greedy (only the most
  likely token is left). There is no seed: Anthropic has none.
* ``system`` blocks whose text starts with ``x-anthropic-`` (Claude Code's
  billing/attribution line, which changes between sessions) are dropped, or
  every session would get a different prompt prefix and no cache reuse.
* Images (``image`` blocks, in a user message or inside a ``tool_result``, as
  Claude Code's Read tool returns a picture) are decoded here and kept in the
  message's parts; a vision model reads them, and a model without vision
  refuses them unless the server allows a placeholder (turns.py). ``url``
  sources are fetched only where the server allows it (image_inputs.py).
  Non-text documents become a short placeholder text; blocks of unknown types
  are rendered as nothing.
* Thinking blocks are the assistant turn's reasoning, given to the chat
  template (which decides whether it renders): the text their signature
  carries when it is one of this server's (reasoning_signature.py), so
  ``display: "omitted"`` blocks sent back empty render as they were written;
  a ``redacted_thinking`` block likewise, else nothing. ``thinking`` and
  ``output_config.effort`` set the reasoning's budget, and
  ``context_management``'s ``clear_thinking`` keep-all what earlier reasoning
  the template keeps where it has a switch for it (reasoning_ask.py).
* Several text parts of one message are joined with a blank line; a string
  content is one text block (see anthropic_schemas), so both spellings match.
* The agent identity hashes the top-level ``system`` and the tools only:
  Claude Code's mid-conversation system message (environment info) is part
  of the conversation, not of the prefix that names the agent.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from engine.errors import InvalidRequestError

from .anthropic_schemas import (
    ContentBlock,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    InputMessage,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from engine.domain.chat import ChatMessage, Conversation, ImagePart, Part, ToolCall, ToolSpec
from .identity import anthropic_identity, with_client_hints
from .request_priority import asked_priority
from .image_inputs import IMAGE_PLACEHOLDER, from_base64, from_url, image_text
from .retention import retention_of
from .output_formats import anthropic_output_format
from .reasoning_ask import ReasoningAsk, anthropic_reasoning
from .reasoning_signature import reasoning_of, restored
from .turns import GREEDY, SamplingAsked, TurnSpec

log = logging.getLogger("semantic.api.anthropic")

DOCUMENT_PLACEHOLDER = "[document omitted: this model can only read plain-text documents]"
ATTRIBUTION_PREFIX = "x-anthropic-"
PART_SEPARATOR = "\n\n"


# -- content --------------------------------------------------------------------------------
def block_text(block: ContentBlock) -> str | None:
    """The prompt text of a non-structural block; None for blocks rendered as nothing."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, ImageBlock):
        return IMAGE_PLACEHOLDER
    if isinstance(block, DocumentBlock):
        return _document_text(block)
    if block.type not in ("thinking", "redacted_thinking"):
        log.debug("content block of type %r rendered as nothing", block.type)
    return None


def _document_text(block: DocumentBlock) -> str:
    data = block.source.get("data")
    if block.source.get("type") == "text" and isinstance(data, str):
        return f"{block.title}\n\n{data}" if block.title else data
    return DOCUMENT_PLACEHOLDER


def joined_text(blocks: Iterable[ContentBlock]) -> str:
    parts = (block_text(b) for b in blocks)
    return PART_SEPARATOR.join(p for p in parts if p)


def image_of(block: ImageBlock, field: str) -> ImagePart:
    source = block.source
    kind = source.get("type")
    if kind == "base64":
        data = source.get("data")
        if not isinstance(data, str):
            raise InvalidRequestError(f"{field}.source.data: a base64 image needs its data as a string",
                                      field=f"{field}.source.data")
        return from_base64(data, str(source.get("media_type") or ""), f"{field}.source.data")
    if kind == "url" and isinstance(source.get("url"), str):
        return from_url(source["url"], f"{field}.source.url")
    raise InvalidRequestError(f"{field}.source: an image source must be base64 or url (got {kind!r})",
                              field=f"{field}.source")


def content_of(blocks: Iterable[tuple[int, ContentBlock]], field: str) -> tuple[str, tuple[Part, ...]]:
    """Blocks' text (an image a placeholder) and, when they hold images, their parts in order; each block with
    its index in ``field``."""
    parts: list[Part] = []
    for at, block in blocks:
        if isinstance(block, ImageBlock):
            parts.append(image_of(block, f"{field}.{at}"))
        else:
            text = block_text(block)
            if text:
                parts.append(text)
    return image_text(parts)


def _tool_result(block: ToolResultBlock, field: str, tool_names: dict[str, str]) -> ChatMessage:
    text, parts = content_of(enumerate(block.content or []), f"{field}.content")
    if block.is_error:
        text = f"Error: {text}"
        if parts:
            parts = ((f"Error: {parts[0]}", *parts[1:]) if isinstance(parts[0], str) else ("Error: ", *parts))
    return ChatMessage("tool", text, tool_call_id=block.tool_use_id, name=tool_names.get(block.tool_use_id),
                       parts=parts)


def system_message(blocks: list[ContentBlock] | None) -> ChatMessage | None:
    kept = [b for b in blocks or [] if not (isinstance(b, TextBlock) and b.text.startswith(ATTRIBUTION_PREFIX))]
    text = joined_text(kept)
    return ChatMessage("system", text) if text else None


# -- messages -------------------------------------------------------------------------------
def chat_messages(message: InputMessage, index: int, tool_names: dict[str, str]) -> list[ChatMessage]:
    if message.role == "assistant":
        return [_assistant(message, index, tool_names)]
    _reject(message, index, ToolUseBlock, "tool_use blocks belong in assistant messages")
    if message.role == "system":
        _reject(message, index, ToolResultBlock, "tool_result blocks belong in user messages")
        return [ChatMessage("system", joined_text(message.content))]
    return _user(message, index, tool_names)


def _assistant(message: InputMessage, index: int, tool_names: dict[str, str]) -> ChatMessage:
    _reject(message, index, ToolResultBlock, "tool_result blocks belong in user messages")
    calls = tuple(ToolCall(b.id, b.name, b.input) for b in message.content if isinstance(b, ToolUseBlock))
    tool_names.update({call.id: call.name for call in calls})
    return ChatMessage("assistant", joined_text(message.content), tool_calls=calls, reasoning=reasoning_text(message))


def reasoning_text(message: InputMessage) -> str:
    """The reasoning of an assistant turn's thinking (and redacted thinking) blocks, in their order."""
    parts = []
    for block in message.content:
        if isinstance(block, ThinkingBlock):
            parts.append(restored(block.thinking, block.signature))
        elif isinstance(block, RedactedThinkingBlock):
            parts.append(reasoning_of(block.data) or "")
    return PART_SEPARATOR.join(p for p in parts if p)


def _user(message: InputMessage, index: int, tool_names: dict[str, str]) -> list[ChatMessage]:
    """Text and tool results in their order: each tool result is its own tool message."""
    out: list[ChatMessage] = []
    pending: list[tuple[int, ContentBlock]] = []
    field = f"messages.{index}.content"
    for at, block in enumerate(message.content):
        if not isinstance(block, ToolResultBlock):
            pending.append((at, block))
            continue
        if pending:
            out.append(_user_message(pending, field))
            pending = []
        out.append(_tool_result(block, f"{field}.{at}", tool_names))
    if pending or not out:
        out.append(_user_message(pending, field))
    return out


def _user_message(blocks: list[tuple[int, ContentBlock]], field: str) -> ChatMessage:
    text, parts = content_of(blocks, field)
    return ChatMessage("user", text, parts=parts)


def _reject(message: InputMessage, index: int, kind: type, reason: str) -> None:
    for at, block in enumerate(message.content):
        if isinstance(block, kind):
            raise InvalidRequestError(f"messages.{index}.content.{at}: {reason}", field=f"messages.{index}.content")


# -- conversation and turn ---------------------------------------------------------------------
def tool_choice_of(choice: ToolChoice | None) -> str:
    if choice is None:
        return "auto"
    return choice.name if choice.type == "tool" and choice.name else choice.type


def tool_specs(body: CountTokensRequest) -> tuple[ToolSpec, ...]:
    return tuple(ToolSpec(t.name, t.description or "", t.input_schema, bool(t.strict)) for t in body.tools or [])


def conversation_of(body: CountTokensRequest, reasoning: ReasoningAsk | None = None) -> Conversation:
    system = system_message(body.system)
    messages: list[ChatMessage] = [system] if system else []
    tool_names: dict[str, str] = {}
    for index, message in enumerate(body.messages):
        messages.extend(chat_messages(message, index, tool_names))
    single = bool(body.tool_choice and body.tool_choice.disable_parallel_tool_use)
    if reasoning is None:  # count_tokens: no max_tokens to hold a budget to, the template's form is what counts
        reasoning = anthropic_reasoning(body.thinking, getattr(body, "output_config", None), 1 << 62,
                                        body.context_management)
    return Conversation(tuple(messages), tool_specs(body), tool_choice_of(body.tool_choice), not single,
                        template_kwargs=reasoning.kwargs())


def prefix_of(body: CountTokensRequest) -> Conversation:
    """What names the agent: top-level system and tools, without the conversation."""
    system = system_message(body.system)
    return Conversation((system,) if system else (), tool_specs(body), tool_choice_of(body.tool_choice))


def sampling_of(body: MessagesRequest) -> SamplingAsked:
    if body.top_p is not None and body.top_p == 0:
        return GREEDY
    return SamplingAsked(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)


def turn_spec(body: MessagesRequest, headers: Mapping[str, str]) -> TurnSpec:
    metadata: dict[str, Any] = body.metadata.model_dump() if body.metadata else {}
    identity = with_client_hints(anthropic_identity(headers, prefix_of(body), metadata, body.max_tokens, body.model),
                                 headers)
    reasoning = anthropic_reasoning(body.thinking, body.output_config, body.max_tokens, body.context_management)
    return TurnSpec(
        conversation=conversation_of(body, reasoning),
        identity=identity,
        max_tokens=body.max_tokens,
        sampling=sampling_of(body),
        stop=tuple(s for s in body.stop_sequences or [] if s),
        model=body.model,
        retention=retention_of(body),
        output_format=anthropic_output_format(body.output_config, body.output_format),
        output_field="output_config.format",
        reasoning=reasoning,
        priority=asked_priority(metadata.get("priority"), "metadata.priority", headers),
    )
