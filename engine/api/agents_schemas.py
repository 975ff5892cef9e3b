"""Bodies of the direct agent API, and its responses for /docs and schema checks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateAgentBody(_Body):
    agent_id: str | None = Field(None, description="Generated when absent.")
    system: str | None = Field(None, description="System prompt of every turn.")
    display_name: str | None = None


class EvictBody(_Body):
    tier: Literal["warm", "cold"] = "warm"


class PinBody(_Body):
    pinned: bool


class MessageBody(_Body):
    content: str = Field(min_length=1, description="The user message.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="Absent: the model's default (see /v1/stats)")
    stop: str | list[str] | None = None
    stream: bool = False


class AgentOut(BaseModel):
    agent_id: str
    display_name: str | None
    source: str
    state: str
    tier: Literal["hot", "warm", "cold", "empty"]
    pinned: bool
    cached_tokens: int
    blocks: int
    bytes: int
    turns: int
    reuse_ratio: float
    last_ttft_s: float | None
    decode_tok_s: float | None
    last_used: float
    last_finish: str | None = Field(None, description="How the last turn ended: stop, stop_sequence, length, "
                                    "repetition (a runaway loop cut short), capacity, cancelled, error")
    last_finish_note: str | None = Field(None, description="Why, when the server ended it (a loop, the output cap)")
    messages: int = Field(description="Messages in the stored conversation (0 for agents of other APIs).")
    has_conversation: bool


class AgentList(BaseModel):
    object: Literal["list"]
    data: list[AgentOut]


class Deleted(BaseModel):
    agent_id: str
    deleted: bool


class TurnUsage(BaseModel):
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    ttft_s: float | None
    decode_tok_s: float | None


class TurnResult(BaseModel):
    agent_id: str
    content: str
    finish_reason: Literal["stop", "stop_sequence", "length"]
    usage: TurnUsage


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorOut(BaseModel):
    type: Literal["error"]
    error: ErrorDetail


TURN_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {"event": {"type": "string", "enum": ["token", "done", "error"]}, "data": {"type": "string"}},
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {400: "Invalid agent id or body", 404: "No such agent", 409: "Exists already, or busy",
                 429: "No room in the KV pool now", 500: "Generation failed",
                 503: "No model loaded, or the agent is generating"}
    return {status: {"model": ErrorOut, "description": described[status]} for status in statuses}
