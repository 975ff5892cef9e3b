"""Request and response bodies of the Anthropic Messages API, as pydantic models.

Requests are lenient where real clients need it: unknown fields are ignored
(Claude Code sends ``context_management``, ``output_config`` and more), a
string content is read as one text block (so both spellings render the same
tokens), and content blocks of types this server does not know are kept as
``OtherBlock`` and rendered as nothing. The response models exist for the
OpenAPI document; the routes build plain dicts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class CacheControl(_Request):
    """A prompt-caching breakpoint: keep what precedes it for ``ttl`` (engine/api/retention.py)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class _Cacheable(_Request):
    cache_control: CacheControl | None = None


# -- content blocks ------------------------------------------------------------------------
class TextBlock(_Cacheable):
    type: Literal["text"]
    text: str


class ImageBlock(_Cacheable):
    type: Literal["image"]
    source: dict[str, Any] = Field(default_factory=dict, description="base64 or url source; never read by this server")


class DocumentBlock(_Cacheable):
    type: Literal["document"]
    source: dict[str, Any] = Field(default_factory=dict, description="plain-text sources are read, others are omitted")
    title: str | None = None


class ToolUseBlock(_Cacheable):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Cacheable):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Content | None = None
    is_error: bool | None = None


class ThinkingBlock(_Request):
    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str = ""


KNOWN_BLOCKS = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")


class OtherBlock(_Request):
    """A block type newer than this server: accepted, rendered as nothing."""

    type: str = Field(json_schema_extra={"not": {"enum": list(KNOWN_BLOCKS)}})


def _block_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return kind if kind in KNOWN_BLOCKS else "other"


ContentBlock = Annotated[
    Union[
        Annotated[TextBlock, Tag("text")],
        Annotated[ImageBlock, Tag("image")],
        Annotated[DocumentBlock, Tag("document")],
        Annotated[ToolUseBlock, Tag("tool_use")],
        Annotated[ToolResultBlock, Tag("tool_result")],
        Annotated[ThinkingBlock, Tag("thinking")],
        Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
        Annotated[OtherBlock, Tag("other")],
    ],
    Discriminator(
        _block_kind,
        custom_error_type="invalid_content_block",
        custom_error_message="a content block must be an object with a string 'type'",
    ),
]


def _string_as_text_block(value: Any) -> Any:
    """A string content is exactly one text block: both spellings must give the same prompt."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("content must be a string or a list of content blocks")
    return value


Content = Annotated[
    list[ContentBlock],
    BeforeValidator(_string_as_text_block, json_schema_input_type=Union[str, list[ContentBlock]]),
]
ToolResultBlock.model_rebuild()


# -- request -------------------------------------------------------------------------------
class InputMessage(_Request):
    # "system" mid-conversation is not in Anthropic's reference, but Claude Code sends it.
    role: Literal["user", "assistant", "system"]
    content: Content


class Tool(_Cacheable):
    name: str = Field(min_length=1)
    description: str | None = None
    # Server tools (web search and friends) come without a schema.
    input_schema: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = Field(None, description="Calls follow input_schema exactly (constrained decoding)")


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _tool_needs_name(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        return self


class Metadata(_Request):
    user_id: str | None = None
    # Extension of this server: the turn's priority level, 0-9 (0 most urgent) or a class name
    # (request_priority.py).
    priority: int | str | None = None


class CountTokensRequest(_Request):
    """What ``/v1/messages/count_tokens`` reads; ``/v1/messages`` adds the generation fields."""

    model: str = Field(description="Any name: the loaded model answers, and the name is echoed back")
    messages: list[InputMessage] = Field(min_length=1)
    system: Content | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = Field(
        None, description="A thinking model's reasoning: {type: enabled, budget_tokens}, {type: adaptive} (budget from "
                          "output_config.effort), {type: disabled}; display: omitted returns empty thinking text "
                          "(engine/api/reasoning_ask.py). Absent: the model's default, no budget")
    cache_control: CacheControl | None = Field(
        None, description="Automatic caching: a breakpoint at the last cacheable block")
    context_management: dict[str, Any] | None = Field(
        None, description="clear_thinking with keep: all asks that earlier reasoning stay in the prompt: passed to "
                          "templates that have the switch (GLM's clear_thinking, Gemma 4's preserve_thinking); other "
                          "edits are accepted and ignored")


class DiagnosticsIn(_Request):
    """Cache diagnostics (beta ``cache-diagnosis-2026-04-07``): null on the first turn to opt in."""

    previous_message_id: str | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, description="Clamped to what the context leaves")
    speed: str | None = Field(None, description="Accepted and ignored (one model speed here); cache "
                                                "diagnostics count a change as model_changed, as the API does")
    diagnostics: DiagnosticsIn | None = Field(
        None, description="With the beta header cache-diagnosis-2026-04-07: why this request missed the cache of "
                          "the one named by previous_message_id (engine/api/cache_diagnostics.py)")
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1, description="Absent: the model's own default (generation_config.json)")
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    output_config: dict[str, Any] | None = Field(
        None, description="format: {type: json_schema, schema}: the reply is JSON that validates against the schema "
                          "(structured outputs); effort (low, medium, high, max) sets adaptive thinking's budget")
    output_format: dict[str, Any] | None = Field(None, description="The structured-outputs beta's name for "
                                                                  "output_config.format")


# -- responses (documentation of what the routes return) -------------------------------------
class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str = Field(description="The reasoning (empty with display: omitted)")
    signature: str = Field(description="Carries the reasoning; send the block back unchanged in a tool loop")


class UsageOut(BaseModel):
    input_tokens: int = Field(description="Prompt tokens prefilled for this request")
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = Field(description="Prompt tokens served from the agent's cache")


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Annotated[Union[ThinkingOut, TextOut, ToolUseOut], Field(discriminator="type")]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: UsageOut
    diagnostics: dict[str, Any] | None = Field(
        None, description="Only with the cache diagnostics beta: {cache_miss_reason: {type, cache_missed_input_tokens}}, "
                          "or null when nothing diverged")


STREAM_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop", "ping", "error")

# One server-sent event of a streamed message (OpenAPI 3.1: the event-stream
# schema describes each event); ``data`` is JSON whose ``type`` names the event.
STREAM_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "enum": list(STREAM_EVENTS)},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"type": "object", "required": ["type"],
                                   "properties": {"type": {"type": "string", "enum": list(STREAM_EVENTS)}}}},
    },
}


class CountTokensResponse(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
