"""Bodies of the direct agent API, and its responses for /docs and schema checks."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from engine.runtime.engine_thread.snapshot import AgentView


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


class PriorityBody(_Body):
    priority: int | str | None = Field(
        description="The agent's level, 0-9 (0 most urgent) or a class name (interactive, main, side, subagent, "
                    "background) for that class's default; null: back to its requests' and class's")


class PauseBody(_Body):
    paused: bool = Field(description="true: the agent's turns wait (its cache stays); false: they go on")


class MessageBody(_Body):
    content: str = Field(min_length=1, description="The user message.")
    images: list[str] = Field(default_factory=list, description="Images sent with the message, before its text, for "
                              "a vision model: data URLs (data:image/png;base64,...), or http(s) URLs where the server "
                              "fetches them (--allow-image-urls). Kept in the agent's history.")
    model: str | None = Field(None, description="Which resident model answers (an alias of --model or "
                                                "--extra-model, or a name --model-route maps); absent: the default")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="Absent: the model's default (see /v1/stats)")
    stop: str | list[str] | None = None
    stream: bool = False
    response_format: dict[str, Any] | None = Field(
        None, description="Structured outputs, as in chat completions: {type: json_schema, json_schema: {name, schema}} "
                          "or {type: json_object}; the reply is JSON that validates against the schema")
    reasoning_effort: str | None = Field(
        None, description="A thinking model's reasoning budget: none (off), minimal, low, medium, high, xhigh "
                          "(as in chat completions); absent: the model's default, no budget")
    priority: int | str | None = Field(
        None, description="This turn's priority level, 0-9 (0 most urgent) or a class name for its default; absent: "
                          "the agent's (POST /v1/agents/{id}/priority) or its class's")
    agent_class: Literal["interactive", "main", "side", "subagent", "background"] | None = Field(
        None, description="Who the agent is: interactive (a person typing, as the workbench's chats are), main "
                          "(default), side, subagent, background (nobody waits on it)")


class CacheDivergenceOut(BaseModel):
    token: int = Field(description="Index of the first prompt token that differs from the cached tokens")
    block: int = Field(description="The KV block (of block_tokens) that token falls in")
    region: str = Field(description="'system prompt and tools' or 'messages'")
    cached_text: str = Field(description="Text around the point as cached: some tokens before it, then the cached tokens")
    prompt_text: str = Field(description="The same span as this turn's prompt has it")
    common_chars: int = Field(description="Characters of both texts before the point (equal on both sides)")
    volatile: str | None = Field(None, description="A span known to change between requests found at the point")
    against: str = Field(description="'own cache', or the agent whose shared prefix the prompt was compared with")


class CacheTurnOut(BaseModel):
    request_id: str
    at: float = Field(description="Unix time the turn was admitted")
    outcome: str = Field(description="full, new_agent, shared, diverged, window, restored, dropped, "
                                     "model_changed, side_request, no_room")
    prompt_tokens: int
    cached_tokens: int = Field(description="Tokens the agent's cache held when the turn arrived")
    reused_tokens: int
    prefilled_tokens: int
    source: str = Field(description="self, shared:<agent>, prefix:<key> (a stored shared prefix) or none")
    note: str | None = None
    divergence: CacheDivergenceOut | None = None


# The agent fields the API publishes: AgentView's (the one description of an agent), less the engine's own.
AGENT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AgentView) if f.metadata["api"])


def _agent_fields() -> dict[str, Any]:
    """AgentView's published fields as the response model's: type, default and description from the view."""
    hints = get_type_hints(AgentView)
    return {f.name: (hints[f.name], Field(f.default if f.default is not dataclasses.MISSING else ...,
                                          description=f.metadata["doc"]))
            for f in dataclasses.fields(AgentView) if f.name in AGENT_FIELDS}


AgentOut = create_model(
    "AgentOut",
    **_agent_fields(),
    model=(str | None, Field(None, description="The model whose cache this is: its alias (--model, --extra-model); "
                                               "an agent of two models is listed once under each")),
    messages=(int, Field(description="Messages in the stored conversation (0 for agents of other APIs).")),
    has_conversation=(bool, Field(description="Whether the server stores the agent's conversation (the direct "
                                              "agent API's agents)")),
)


class AgentDetailOut(AgentOut):  # type: ignore[misc,valid-type] (built from AgentView)
    cache_history: list[CacheTurnOut] = Field(description="How the agent's last turns met its cache, oldest first")


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
    reasoning_tokens: int = Field(0, description="Of the generated tokens, those a thinking model reasoned with")
    ttft_s: float | None
    decode_tok_s: float | None


class TurnResult(BaseModel):
    agent_id: str
    content: str
    reasoning: str = Field("", description="A thinking model's reasoning (markers left out); empty otherwise")
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
    "properties": {"event": {"type": "string", "enum": ["token", "reasoning", "done", "error"]}, "data": {"type": "string"}},
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {400: "Invalid agent id or body", 404: "No such agent", 409: "Exists already, or busy",
                 429: "No room in the KV pool now", 500: "Generation failed",
                 503: "No model loaded, or the agent is generating"}
    return {status: {"model": ErrorOut, "description": described[status]} for status in statuses}


class ForkBody(_Body):
    name: str | None = Field(None, description="The fork's agent id; generated when absent.")
    at_turn: int | None = Field(None, ge=0, description="Fork at the end of this turn (0: empty); absent: at the end.")
    display_name: str | None = None


class RewindBody(_Body):
    turn: int = Field(ge=0, description="Take the agent back to the end of this turn (0: before the first).")


class BranchOut(BaseModel):
    agent: AgentOut = Field(description="The fork (or the rewound agent) as it is now")
    cached_tokens: int = Field(description="Tokens its cache holds after the operation")
    asked_tokens: int = Field(description="Where the turn ends; more than cached_tokens when a sliding-window "
                                          "layer could only go back to an earlier checkpoint (the next turn "
                                          "computes the difference)")
    shared_tokens: int = Field(description="Of those, the positions held in blocks shared by reference")
    messages: int = Field(description="Messages of its stored conversation (direct-API agents)")


class ImportedOut(BaseModel):
    agent: AgentOut = Field(description="The imported agent, warm (its next turn reads it back)")
    tokens: int
    bytes: int
    model: str = Field(description="The model and cache layout that made the file")
    conversation_turns: int | None = Field(description="Turns of the conversation it carried (direct-API agents)")
    replaced: bool
