"""Request bodies of the OpenAI chat completions endpoint.

Only what the server acts on is declared; every other field (``user``,
``logprobs``, ...) is accepted and ignored, because
OpenAI clients send whatever their version knows about and a strict schema
would break them. Responses are built as plain dicts in ``openai_translate``
so their shape is exactly the wire shape.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    """One part of a list content: ``text``, ``image_url``, ``input_audio``, ``file``..."""

    type: str
    text: str | None = None
    # ``image_url``: {"url": "data:image/png;base64,..." or "https://...", "detail": ...} (a bare string is taken too).
    image_url: dict[str, Any] | str | None = None


class FunctionCallIn(_Lenient):
    name: str
    # OpenAI sends the arguments as a JSON *string*; parsed in translation.
    arguments: str = ""


class ToolCallIn(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, sent back (DeepSeek's and llama.cpp's name; mlx-lm and vLLM say reasoning).
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None  # calls follow parameters exactly (constrained decoding); off unless true


class ToolIn(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    # Any name is accepted: the server answers with the model it has loaded.
    model: str | None = None
    messages: list[MessageIn] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1, le=1, description="Only one choice is generated per request.")
    tools: list[ToolIn] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Structured outputs: json_schema or json_object (output_formats.py reads it).
    response_format: dict[str, Any] | None = None
    # Extension of this server: names the agent whose KV cache the request reuses.
    session_id: str | None = None
    # The turn's priority level, 0-9 (0 most urgent) or a class name, as vLLM takes it (request_priority.py).
    priority: int | str | None = None
    # A thinking model's reasoning: none (off), minimal, low, medium, high, xhigh (reasoning_ask.py budgets).
    reasoning_effort: str | None = None
    # Keyword arguments for the chat template, e.g. {"enable_thinking": false} (a common extension).
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# -- responses: documentation for /docs and schema checks; handlers build the dicts -------------
class FunctionOut(BaseModel):
    name: str
    arguments: str = Field(description="The call's arguments as a JSON object, encoded as a string.")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionOut


class MessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the reply is only tool calls")
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = Field(None, description="A thinking model's reasoning (also as reasoning)")
    reasoning: str | None = Field(None, description="The same reasoning, under the name mlx-lm and vLLM use")


class ChoiceOut(BaseModel):
    index: int
    message: MessageOut
    logprobs: None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the agent's KV cache instead of prefilled.")


class SpeculationUsage(BaseModel):
    """Extension: what speculative decoding did for one turn."""

    drafted: int = Field(description="Tokens drafted from the agent's own history and verified by the model")
    accepted: int = Field(description="Of those, the ones the model would have produced itself (kept)")
    acceptance: float = Field(description="accepted / drafted")
    steps: int = Field(description="Speculative steps that verified drafts")
    emitted: int = Field(description="Tokens those steps emitted")
    tokens_per_step: float = Field(description="emitted / steps (plain decoding: 1)")


class CacheUsage(BaseModel):
    """Extension: how the turn met the agent's cache."""

    reuse_source: str = Field(description="self (the agent's own cache), shared:<agent> (another agent's prefix), none")
    reuse_note: str | None = Field(description="Why less was reused than the prompt shares with the cache, if so")
    handoff_in_ms: float = Field(description="Admission to the first prefill chunk: planning and preparing the cache")
    handoff_out_ms: float = Field(description="Last token to the cache settled in the pool")
    copied_bytes: int = Field(description="Bytes of KV copied for this turn (shared prefixes, growth, side copies)")
    cache_outcome: str = Field(description="full, new_agent, shared, diverged, window, restored, dropped, "
                                           "model_changed, side_request, no_room (details: GET /v1/agents/{id})")
    diverged_at: int | None = Field(description="First prompt token that differs from the cached tokens, if any")
    speculation: SpeculationUsage | None = Field(
        None, description="Speculative decoding in this turn (null when the engine does not speculate, or the request had a seed)")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="Of the completion tokens, those the model reasoned with")


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    semantic: CacheUsage


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChoiceOut]
    usage: UsageOut
    agent_id: str = Field(description="Extension: the agent whose cache served the request.")


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorDetail


# One SSE event of a streamed completion: ``data:`` only, a JSON chunk or ``[DONE]``.
STREAM_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}},
}
