"""Responses API requests to the protocol-neutral turn, and the response object back.

The agent of a turn: the stored response it continues (``previous_response_id``:
the same agent, whose cache holds that conversation), else the
``prompt_cache_key`` (Codex's thread id), else the canonical prompt prefix
(identity.responses_identity). Sampling fields left out take the model's
defaults, as in chat completions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from engine.domain.chat import ToolCall
from engine.domain.requests import AgentSource, FinishEvent, Usage
from engine.errors import InvalidRequestError
from engine.settings import Settings
from engine.store.stored_responses import StoredResponse

from .identity import AgentIdentity, is_codex, responses_identity, with_client_hints
from .request_priority import asked_priority
from .openai_translate import cache_usage
from .reasoning_ask import responses_reasoning
from .responses_items import (
    Item,
    function_call_item,
    function_tools,
    message_item,
    new_id,
    reasoning_item,
    to_conversation,
    tool_choice,
)
from .responses_schemas import ResponsesRequest
from .output_formats import responses_text_format
from .turns import SamplingAsked, TurnSpec, ended_by


def to_turn_spec(body: ResponsesRequest, items: list[Item], previous: StoredResponse | None,
                 headers: Mapping[str, str], settings: Settings) -> TurnSpec:
    if body.background:
        raise InvalidRequestError("background responses are not supported; leave background unset", field="background")
    tools = function_tools(body.tools)
    choice = tool_choice(body.tool_choice, tools)
    history = [*(previous.history if previous else ()), *items]
    max_tokens = body.max_output_tokens or settings.default_max_tokens
    reasoning = responses_reasoning(body.reasoning, max_tokens)
    conversation = to_conversation(body.instructions, history, tools, choice, body.parallel_tool_calls is not False,
                                   reasoning.kwargs())
    if not any(m.role != "system" for m in conversation.messages):
        raise InvalidRequestError("input has no message to answer: send a user message or a function_call_output",
                                  field="input")
    identity = _continuing(previous, headers) if previous else responses_identity(headers, body.prompt_cache_key,
                                                                                  conversation)
    return TurnSpec(conversation, with_client_hints(identity, headers), max_tokens,
                    SamplingAsked(temperature=body.temperature, top_p=body.top_p),
                    model=body.model, output_format=responses_text_format(body.text), output_field="text.format",
                    reasoning=reasoning, priority=asked_priority(body.priority, "priority", headers))


def _continuing(previous: StoredResponse, headers: Mapping[str, str]) -> AgentIdentity:
    source = AgentSource.CODEX if is_codex(headers) else AgentSource.OPENAI
    label = "Codex" if source is AgentSource.CODEX else "Responses client"
    return AgentIdentity(previous.agent_id, source, f"{label} {previous.agent_id[-8:]}")


@dataclass(slots=True)
class ResponseMeta:
    """What every state of one response repeats: its id, the agent, and the request's settings echoed back."""

    id: str
    agent_id: str
    model: str
    request: ResponsesRequest
    created_at: float = field(default_factory=time.time)

    @classmethod
    def new(cls, body: ResponsesRequest, model: str, agent_id: str) -> "ResponseMeta":
        return cls(new_id("resp"), agent_id, body.model or model, body)

    def body(self, status: str, output: list[Item], usage: Usage | None = None,
             incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        request = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "prompt_cache_key": request.prompt_cache_key,
            "reasoning": _echoed_reasoning(request.reasoning),
            "store": request.store,
            "temperature": request.temperature,
            "text": _echoed_text(request.text),
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [],
            "top_p": request.top_p,
            "truncation": request.truncation or "disabled",
            "usage": usage_body(usage) if usage is not None else None,
            "user": request.user,
            "metadata": request.metadata or {},
            "agent_id": self.agent_id,
        }


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.reused_tokens},
        "output_tokens": usage.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.generated_tokens,
        "semantic": cache_usage(usage),
    }


def outcome(finish: FinishEvent, made_calls: bool) -> tuple[str, str | None]:
    """The response's status and incomplete reason for a finished (not failed) turn."""
    if ended_by(finish, made_calls) == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def output_items(text: str, calls: list[ToolCall], status: str = "completed", reasoning: str = "",
                 encrypted: bool = False) -> list[Item]:
    """A whole turn's output: its reasoning (a thinking model's) as one reasoning item, its text as one message,
    then one function_call item per call."""
    items: list[Item] = [reasoning_item(new_id("rs"), reasoning, encrypted)] if reasoning else []
    items += [message_item(new_id("msg"), text, status)] if text or not calls else []
    return items + [function_call_item(new_id("fc"), call) for call in calls]


def _echoed_reasoning(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    asked = reasoning or {}
    return {"effort": asked.get("effort"), "summary": asked.get("summary")}


def _echoed_text(text: dict[str, Any] | None) -> dict[str, Any]:
    """The request's ``text`` settings as the response echoes them (``format`` defaults to plain text)."""
    echoed = dict(text or {})
    echoed.setdefault("format", {"type": "text"})
    return echoed
