"""Request body of the OpenAI Responses API (``POST /v1/responses``).

Declared: what the server acts on, and the fields whose wrong type should be
a 400 naming them. Everything else (``client_metadata``, ``service_tier``,
...) is accepted and ignored: clients send whatever their version knows, and Codex sends several
such fields on every turn. ``metadata`` and ``client_metadata`` never reach
the prompt (Codex puts a per-turn timestamp there; rendering it would miss
the cache on every turn).

``input`` items are kept as plain dicts here and read one by one in
``responses_items``, so a malformed item is a 400 naming ``input[i]`` and
its field, not pydantic's union-of-everything error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ResponsesRequest(_Lenient):
    # Any name is accepted: the server answers with the model it has loaded.
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(
        default_factory=list, description="A user message as a string, or a list of input items.")
    instructions: str | None = Field(None, description="A system message placed before the input; "
                                                      "not carried over by previous_response_id.")
    # Tools are read in ``responses_items`` (hosted tools such as ``web_search`` are skipped there).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # Names the agent whose cache the turn reuses (Codex sends its thread id here).
    prompt_cache_key: str | None = None
    # The turn's priority level, 0-9 (0 most urgent) or a class name (request_priority.py).
    priority: int | str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    user: str | None = None
    # ``text.format``: structured outputs (json_schema or json_object; output_formats.py reads it).
    text: dict[str, Any] | None = None
    # ``reasoning.effort``: a thinking model's reasoning budget (reasoning_ask.py; none: off); ``summary`` is echoed.
    reasoning: dict[str, Any] | None = None
    # ``reasoning.encrypted_content``: reasoning items carry their reasoning (reasoning_signature.py) to send back.
    include: list[str] | None = None

    @property
    def includes_encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or ())


# -- responses: documentation for /docs and schema checks; handlers build the dicts ----------
class OutputTextPart(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputItem(BaseModel):
    """A ``message`` (``content``: output_text parts) or a ``function_call`` (``call_id``, ``name``, ``arguments``)."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["message", "function_call", "reasoning"]
    status: Literal["completed", "incomplete", "in_progress"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Input tokens served from the agent's KV cache instead of prefilled.")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: float
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[OutputItem]
    incomplete_details: IncompleteDetails | None
    previous_response_id: str | None
    usage: ResponseUsage | None
    agent_id: str = Field(description="Extension: the agent whose cache served the request.")


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


# One SSE event of a streamed response: ``event:`` names the type, ``data:`` is the JSON event.
STREAM_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
}
