"""The direct agent API: create, list, inspect, delete, evict and pin agents,
and hold stateful conversations with them.

An agent is known to the engine (it has or had a KV cache), to the
conversation store (created here, maybe not run yet), or to both. Every agent
id from a URL or a body is validated before it is used for anything, a file
name included: path parameters arrive percent-decoded, so ``a%20b`` or
``%2E%2E`` reach the handler as ``a b`` and ``..``.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from engine.errors import AgentNotFoundError, EngineUnavailableError, SemanticError
from engine.runtime.tiers.agents import Tier
from engine.domain.forensics import TurnForensics
from engine.domain.requests import FinishEvent
from engine.runtime.engine_thread.snapshot import AgentView, EngineSnapshot
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.engine_ops import DeleteAgent, EvictAgent, PauseAgent, PinAgent, SetAgentPriority

from .admission import SSE_HEADERS, await_admission
from .agent_turns import StatefulTurn, busy_error, start_turn, user_message
from .agents_schemas import (
    AGENT_FIELDS,
    AgentDetailOut,
    TURN_EVENT_SCHEMA,
    AgentList,
    AgentOut,
    CreateAgentBody,
    Deleted,
    EvictBody,
    MessageBody,
    PauseBody,
    PinBody,
    PriorityBody,
    TurnResult,
    errors,
)
from engine.store.conversations import AgentConversation, ConversationStore
from .errors import ApiError
from engine.domain.agent_ids import validate_agent_id
from .metrics import MetricsRecorder
from .request_priority import asked_priority
from .service import EngineService

router = APIRouter(tags=["agents"])


def path_agent_id(agent_id: str) -> str:
    return validate_agent_id(agent_id)


def conversations(request: Request) -> ConversationStore:
    """The app's store, made on first use (its directory follows the service's settings)."""
    store = getattr(request.app.state, "conversations", None)
    if store is None:
        service: EngineService = request.app.state.service
        store = ConversationStore(service.settings.cache_dir / "conversations")
        request.app.state.conversations = store
    return store


async def fresh_snapshot(service: EngineService, engine: Engine | None = None) -> EngineSnapshot | None:
    """A snapshot that reflects every change made so far, after a change this request made.

    Awaited, not waited for on a thread: the engine publishes it between two of its steps. The change is
    made by then, so an engine that cannot publish now (a swap took it away, it is stopping, it is slow)
    gives the last published snapshot instead of an error: a 503 here would tell the client to retry a
    rewind or an eviction that already happened (the crash harness found a rewind reported as 503 and
    done, and a client that then lost track of the conversation).
    """
    if engine is not None:  # one of several resident models'
        try:
            return await service.call_on(engine, lambda e: e.publish_now())
        except (EngineUnavailableError, asyncio.TimeoutError):
            return engine.snapshot()
    last = service.snapshot()
    if not service.is_ready:
        return last
    try:
        return await service.call(lambda engine: engine.publish_now())
    except (EngineUnavailableError, asyncio.TimeoutError):
        return service.snapshot() or last


def agent_body(view: AgentView | None, conversation: AgentConversation | None,
               model: str | None = None) -> dict[str, Any]:
    """One agent as JSON, from the engine's view when it has one; ``model``: the alias of the model whose
    cache it is."""
    if view is None:
        # An agent only the store knows: created here, no turn yet, so no cache anywhere.
        assert conversation is not None
        view = AgentView(conversation.agent_id, conversation.display_name, last_used=conversation.updated_at)
    body = {name: getattr(view, name) for name in AGENT_FIELDS}
    body["speculation"] = asdict(body["speculation"])
    if conversation is not None and conversation.display_name:
        body["display_name"] = conversation.display_name
    body["messages"] = len(conversation.messages) if conversation else 0
    body["has_conversation"] = conversation is not None
    body["model"] = model
    return body


async def _find(request: Request, agent_id: str, fresh: bool = False) -> tuple[AgentView | None, AgentConversation | None]:
    """The agent as the engine last published it (``fresh``: as it is after this request's change)."""
    service: EngineService = request.app.state.service
    snapshot = await fresh_snapshot(service) if fresh else service.snapshot()
    view = snapshot.agent(agent_id) if snapshot is not None else None
    conversation = conversations(request).get(agent_id)
    if view is None and conversation is None:
        raise AgentNotFoundError(agent_id)
    return view, conversation


async def _current(request: Request, agent_id: str, fresh: bool = False) -> dict[str, Any]:
    return agent_body(*await _find(request, agent_id, fresh))


@dataclass(frozen=True, slots=True)
class Located:
    """An agent found among the serving models: its view in the model that holds its cache, if any."""

    view: AgentView | None
    conversation: AgentConversation | None
    model: str | None
    engine: Engine | None

    def body(self) -> dict[str, Any]:
        return agent_body(self.view, self.conversation, self.model)


async def _after_change(request: Request, agent_id: str, found: Located) -> Located:
    """The agent as its engine has it after this request's change (what it last published, where that engine
    cannot answer now: the change is made)."""
    snapshot = await fresh_snapshot(request.app.state.service, found.engine) if found.engine is not None else None
    view = snapshot.agent(agent_id) if snapshot is not None else None
    return Located(view, conversations(request).get(agent_id), found.model, found.engine)


async def _locate(request: Request, agent_id: str, model: str | None) -> Located:
    """The agent in the first serving model that holds it (``model``: in that one only)."""
    service: EngineService = request.app.state.service
    engines = [(alias, engine) for alias, engine in service.served_engines() if model is None or alias == model]
    if model is not None and not engines:
        raise ApiError(404, f"no model {model!r} is serving; GET /v1/models lists them")
    conversation = conversations(request).get(agent_id)
    for alias, engine in engines:
        snapshot = engine.snapshot()
        view = snapshot.agent(agent_id) if snapshot is not None else None
        if view is not None:
            return Located(view, conversation, alias, engine)
    if conversation is None:
        raise AgentNotFoundError(agent_id)
    alias, engine = engines[0] if engines else (None, None)
    return Located(None, conversation, alias, engine)


MODEL_QUERY = Query(None, description="With several resident models: the alias of the model whose cache of the "
                                      "agent is meant (absent: the first that holds one, the default first)")


# -- catalogue --------------------------------------------------------------------------------
@router.post("/v1/agents", status_code=201, summary="Create an agent with an optional system prompt",
             response_model=AgentOut, responses=errors(400, 409))
async def create_agent(body: CreateAgentBody, request: Request) -> JSONResponse:
    agent_id = validate_agent_id(body.agent_id) if body.agent_id is not None else f"agent-{secrets.token_hex(6)}"
    store = conversations(request)
    snapshot = request.app.state.service.snapshot()
    if snapshot is not None and snapshot.agent(agent_id) is not None:
        raise ApiError(409, f"agent {agent_id!r} already exists")
    conversation = await store.acreate(agent_id, body.system, body.display_name)  # 409 if another create won
    return JSONResponse(agent_body(None, conversation), status_code=201)


@router.get("/v1/agents", summary="Every agent: the engine's and those with only a stored conversation",
            response_model=AgentList)
async def list_agents(request: Request) -> dict[str, Any]:
    service: EngineService = request.app.state.service
    stored = {c.agent_id: c for c in await conversations(request).aall()}
    data, seen = [], set()
    for alias, engine in service.served_engines():
        for view in engine.snapshot().agents:
            data.append(agent_body(view, stored.get(view.agent_id), alias))
            seen.add(view.agent_id)
    data += [agent_body(None, stored[i]) for i in stored if i not in seen]
    return {"object": "list", "data": data}


@router.get("/v1/agents/{agent_id}", summary="One agent, with how its last turns met its cache",
            response_model=AgentDetailOut, responses=errors(400, 404))
async def get_agent(request: Request, agent_id: str = Depends(path_agent_id),
                    model: str | None = MODEL_QUERY) -> dict[str, Any]:
    found = await _locate(request, agent_id, model)
    body = found.body()
    body["cache_history"] = [turn_json(t) for t in found.view.history] if found.view is not None else []
    return body


def turn_json(turn: TurnForensics) -> dict[str, Any]:
    body = {name: getattr(turn, name) for name in ("request_id", "at", "prompt_tokens", "cached_tokens",
                                                    "reused_tokens", "prefilled_tokens", "source", "note")}
    body["outcome"] = turn.outcome.value
    body["divergence"] = asdict(turn.divergence) if turn.divergence is not None else None
    return body


@router.delete("/v1/agents/{agent_id}", summary="Delete an agent: its KV blocks, disk cache and conversation",
               response_model=Deleted, responses=errors(400, 404, 409, 503))
async def delete_agent(request: Request, agent_id: str = Depends(path_agent_id),
                       model: str | None = MODEL_QUERY) -> dict[str, Any]:
    found = await _locate(request, agent_id, model)
    store = conversations(request)
    if store.is_busy(agent_id):
        raise busy_error(agent_id)
    if found.view is not None and found.engine is not None:
        try:
            await request.app.state.service.call_on(found.engine, DeleteAgent(agent_id))
        except AgentNotFoundError:
            pass  # gone between the snapshot and the call: the goal is met
    await store.adelete(agent_id)
    return {"agent_id": agent_id, "deleted": True}


# -- cache control ----------------------------------------------------------------------------
@router.post("/v1/agents/{agent_id}/evict", summary="Move an agent's cache to the warm (disk) or cold tier",
             response_model=AgentOut, responses=errors(400, 404, 503))
async def evict_agent(
    request: Request, body: EvictBody | None = None, agent_id: str = Depends(path_agent_id),
    model: str | None = MODEL_QUERY,
) -> dict[str, Any]:
    found = await _locate(request, agent_id, model)
    tier = Tier((body or EvictBody()).tier)
    # An agent that never ran has no cache to move; answering with it unchanged is the truth.
    if found.view is not None and found.engine is not None:
        await request.app.state.service.call_on(found.engine, EvictAgent(agent_id, tier))
    return (await _after_change(request, agent_id, found)).body()


@router.post("/v1/agents/{agent_id}/pin", summary="Pin (never evict) or unpin an agent's cache",
             response_model=AgentOut, responses=errors(400, 404, 409, 503))
async def pin_agent(body: PinBody, request: Request, agent_id: str = Depends(path_agent_id),
                    model: str | None = MODEL_QUERY) -> dict[str, Any]:
    return await _changed(request, agent_id, model, "pin it", PinAgent(agent_id, body.pinned))


@router.post("/v1/agents/{agent_id}/priority", summary="Set (or clear) an agent's priority level",
             response_model=AgentOut, responses=errors(400, 404, 409, 503))
async def set_agent_priority(body: PriorityBody, request: Request, agent_id: str = Depends(path_agent_id),
                             model: str | None = MODEL_QUERY) -> dict[str, Any]:
    """Its queued and running turns move at once; later turns keep the level until it is cleared (null)."""
    level = None if body.priority is None else asked_priority(body.priority, "priority", {})
    return await _changed(request, agent_id, model, "set its priority",
                          SetAgentPriority(agent_id, level))


@router.post("/v1/agents/{agent_id}/pause", summary="Pause or resume an agent's turns",
             response_model=AgentOut, responses=errors(400, 404, 409, 503))
async def pause_agent(body: PauseBody, request: Request, agent_id: str = Depends(path_agent_id),
                      model: str | None = MODEL_QUERY) -> dict[str, Any]:
    """A paused agent's running turn stops where it is (its cache and its stream stay open) and its queued
    turns wait; resuming goes on from the same token."""
    return await _changed(request, agent_id, model, "pause it", PauseAgent(agent_id, body.paused))


async def _changed(request: Request, agent_id: str, model: str | None, what: str, op: Any) -> dict[str, Any]:
    """Run ``op`` on the engine that holds the agent and answer with the agent as it is after; a 409 naming
    ``what`` while the agent has not run here yet."""
    found = await _locate(request, agent_id, model)
    if found.view is None or found.engine is None:
        raise ApiError(409, f"agent {agent_id!r} has not run on this server yet; {what} once it has a turn")
    await request.app.state.service.call_on(found.engine, op)
    return (await _after_change(request, agent_id, found)).body()


# -- conversation -----------------------------------------------------------------------------
@router.post("/v1/agents/{agent_id}/messages", summary="Send a user message; the server keeps the history",
             response_model=None, responses={
                 200: {"model": TurnResult, "description": "The reply, or with `stream: true` server-sent events",
                       "content": {"text/event-stream": {"schema": TURN_EVENT_SCHEMA}}},
                 **errors(400, 404, 409, 429, 500, 503)})
async def post_message(body: MessageBody, request: Request, agent_id: str = Depends(path_agent_id)) -> Response:
    service: EngineService = request.app.state.service
    metrics: MetricsRecorder = request.app.state.metrics
    store = conversations(request)
    conversation = await store.aget(agent_id)
    if conversation is None:
        raise ApiError(404, f"agent {agent_id!r} has no conversation; create it with POST /v1/agents")
    if not store.claim(agent_id):
        raise busy_error(agent_id)
    try:
        user = user_message(body)  # (a bad image is a 400 naming its field)
        turn = await start_turn(service, conversation, body, user)
    except BaseException as exc:
        store.release(agent_id)
        if isinstance(exc, SemanticError):
            metrics.observe("agents", None, outcome="rejected")
        raise

    def on_end(finish: FinishEvent | None) -> None:
        metrics.observe("agents", finish, outcome=None if finish else "disconnected")

    stateful = StatefulTurn(store, agent_id, user, turn, on_end)
    if not body.stream:
        return JSONResponse(await stateful.complete(request.is_disconnected))
    ping_s = service.settings.ping_interval_s
    try:
        seen = await await_admission(turn, ping_s)
    except BaseException:
        await stateful.settle()
        raise
    return StreamingResponse(stateful.sse(seen, ping_s), media_type="text/event-stream",
                             headers=SSE_HEADERS, background=BackgroundTask(stateful.settle))
