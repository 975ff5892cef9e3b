"""Fork and rewind over HTTP: ``POST /v1/agents/{id}/fork`` and ``POST /v1/agents/{id}/rewind``.

The engine does the cache work (runtime/tiers/branching.py). Here the turn a client
names is turned into a cut the engine can make:

- a direct-API agent (one with a stored conversation) is cut where the
  rendering of its conversation up to that turn, followed by a new user
  message, leaves its cached tokens; that works after a restart too, and the
  fork's conversation is a copy of those messages (a rewind trims them);
- any other agent (Claude Code, OpenAI sessions) is cut at the token count the
  engine recorded at the end of that turn. Its fork is a direct-API agent whose
  stored conversation starts from those tokens (``context_tokens``): its
  messages are rendered as the chat template continues a conversation after an
  assistant turn, so ``POST /v1/agents/{fork}/messages`` extends the shared cache.

Errors: unknown agent 404, turn out of range 400, a fork name in use 409, the
agent generating 409.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from fastapi import APIRouter, Depends, Request

from engine.runtime.tiers.branching import Branch, CacheStillLoading
from engine.domain.requests import AgentSource
from engine.runtime.engine_thread.engine_ops import ForkAgent, RewindAgent

from .agent_turns import busy_error, context_prompt
from .agents_routes import MODEL_QUERY, Located, _after_change, _locate, conversations, path_agent_id
from .agents_schemas import BranchOut, ForkBody, RewindBody, errors
from engine.store.conversations import AgentConversation
from .errors import ApiError
from engine.domain.agent_ids import validate_agent_id
from .service import EngineService
from .turns import render_tokens
from engine.runtime.engine_thread.engine import Engine

router = APIRouter(tags=["agents"])

# How long a fork or rewind waits for an agent evicted to disk to be read back.
RESTORE_WAIT_S = 120.0


@router.post("/v1/agents/{agent_id}/fork", status_code=201, response_model=BranchOut,
             summary="A new agent starting from this agent's cache (at its end or at the end of a turn)",
             responses=errors(400, 404, 409, 429, 503))
async def fork_agent(body: ForkBody, request: Request, agent_id: str = Depends(path_agent_id),
                     model: str | None = MODEL_QUERY) -> dict[str, Any]:
    found = await _locate(request, agent_id, model)
    view, conversation, engine = found.view, found.conversation, found.engine
    store = conversations(request)
    new_id = validate_agent_id(body.name, "name") if body.name else f"{agent_id[:100]}-fork-{secrets.token_hex(3)}"
    if await store.aget(new_id) is not None or _known(request, new_id):
        raise ApiError(409, f"agent {new_id!r} already exists")
    if store.is_busy(agent_id):
        raise busy_error(agent_id)
    prompt, messages = await _cut(request, conversation, body.at_turn, engine)
    name = body.display_name or f"fork of {agent_id}"
    branch = Branch(new_id, 0, 0, 0, 0)
    if view is not None:
        branch = await _on_engine(request, ForkAgent(
            agent_id, new_id, body.at_turn if prompt is None else None, prompt, name, AgentSource.API),
            engine)
    if conversation is not None:
        await store.acopy(conversation, new_id, name, messages)
    elif branch.tokens:
        # Another client's agent: the fork is a direct agent whose messages continue that context.
        context = await _on_engine(request, lambda e: list(e.agents.get(new_id).tokens), engine)
        await store.acreate_on_context(new_id, name, context)
    return await _result(request, new_id, branch, found)


@router.post("/v1/agents/{agent_id}/rewind", response_model=BranchOut,
             summary="Take an agent back to the end of an earlier turn (its cache, and its conversation)",
             responses=errors(400, 404, 409, 429, 503))
async def rewind_agent(body: RewindBody, request: Request, agent_id: str = Depends(path_agent_id),
                       model: str | None = MODEL_QUERY) -> dict[str, Any]:
    found = await _locate(request, agent_id, model)
    view, conversation, engine = found.view, found.conversation, found.engine
    store = conversations(request)
    if not store.claim(agent_id):
        raise busy_error(agent_id)
    try:
        prompt, messages = await _cut(request, conversation, body.turn, engine)
        branch = Branch(agent_id, 0, 0, 0, 0)
        if view is not None:
            turn = body.turn if prompt is None else None
            branch = await _on_engine(request, RewindAgent(agent_id, turn, prompt), engine)
        if conversation is not None:
            await store.atruncate(agent_id, len(messages))
    finally:
        store.release(agent_id)
    return await _result(request, agent_id, branch, found)


async def _cut(request: Request, conversation: AgentConversation | None, turn: int | None,
               engine: Engine | None) -> tuple[tuple[int, ...] | None, list]:
    """(the prompt whose shared prefix is the cut, the messages kept) for a direct-API agent; else (None, [])."""
    if conversation is None:
        return None, []
    turns = len(conversation.messages) // 2
    if turn is None:
        turn = turns
    if turn > turns:
        raise ApiError(400, f"turn {turn} is out of range: agent {conversation.agent_id!r} has turns 0-{turns}",
                       param="turn")
    kept = conversation.messages[:2 * turn]
    cut = AgentConversation(conversation.agent_id, conversation.display_name, conversation.system, kept,
                            context_tokens=conversation.context_tokens)
    service: EngineService = request.app.state.service
    # What the next turn would send, up to its user message: the cache is kept as far as it matches.
    tokens = (await context_prompt(service, cut, " ", engine)
              or await render_tokens(service, cut.with_user_message(" "), engine))
    return tuple(tokens), kept


async def _on_engine(request: Request, operation: Any, engine: Engine | None) -> Any:
    """Run a branching operation on the engine thread of the agent's model, waiting while an evicted agent is
    read back."""
    service: EngineService = request.app.state.service
    deadline = asyncio.get_running_loop().time() + RESTORE_WAIT_S
    while True:
        try:
            return await (service.call_on(engine, operation) if engine is not None else service.call(operation))
        except CacheStillLoading:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)


def _known(request: Request, agent_id: str) -> bool:
    service: EngineService = request.app.state.service
    return any(engine.snapshot().agent(agent_id) is not None for _, engine in service.served_engines())


async def _result(request: Request, agent_id: str, branch: Branch, found: Located) -> dict[str, Any]:
    after = await _after_change(request, agent_id, found)
    if after.view is None and after.conversation is None:  # a fork of an agent with nothing cached and no conversation
        raise ApiError(404, f"agent {agent_id!r} has nothing to fork")
    agent = after.body()
    return {"agent": agent, "cached_tokens": branch.tokens, "asked_tokens": branch.asked_tokens,
            "shared_tokens": branch.shared_tokens, "messages": agent.get("messages", 0)}
