"""The Anthropic Messages API: ``POST /v1/messages`` (streaming or not),
``POST /v1/messages/count_tokens`` and Claude Code's ``/api/hello`` probe.

Query strings (Claude Code's ``?beta=true``) do not take part in routing.
A failure the engine reports before the stream has sent anything (no pool
room at admission) is still answered with a plain HTTP error (429 with
``retry-after``); after the 200 it becomes an ``event: error`` frame.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.domain.requests import FinishEvent
from engine.errors import SemanticError

from .anthropic_schemas import (
    STREAM_EVENT_SCHEMA,
    CountTokensRequest,
    CountTokensResponse,
    ErrorResponse,
    MessageResponse,
    MessagesRequest,
)
from .anthropic_stream import (
    ContentBlocks,
    MessageHead,
    MessageStream,
    Recorder,
    SseResponse,
    error_if_failed,
    first_event,
    message_body,
)
from .anthropic_translate import conversation_of, turn_spec
from .async_turn import AsyncTurn
from .cache_diagnostics import Fingerprint, FingerprintStore, diagnose, wants_diagnostics
from .completion import run_to_end
from .errors import ApiError
from .reply_model import reply_model
from .service import EngineService
from .turns import OutputAssembler, cap_headers, prepare, render_tokens

router = APIRouter(tags=["anthropic"])

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request (also: prompt is too long)"),
        (429, "No room in the KV pool now"),
        (500, "Generation failed"),
        (503, "No model loaded, or generation cancelled"),
    )
}
MESSAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": MessageResponse, "description": "The message, or with `stream: true` a server-sent event stream",
          "content": {"text/event-stream": {"schema": STREAM_EVENT_SCHEMA}}},
    **ERRORS,
}


def _service(request: Request) -> EngineService:
    return request.app.state.service


def _recorder(request: Request) -> Recorder:
    def record(finish: FinishEvent | None, outcome: str | None = None) -> None:
        request.app.state.metrics.observe("anthropic", finish, outcome)

    return record


@router.post("/v1/messages", summary="Create a message (Anthropic Messages API)",
             response_model=None, responses=MESSAGE_RESPONSES)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    service, record = _service(request), _recorder(request)
    try:
        spec = turn_spec(body, request.headers)
        prepared = await prepare(service, spec, request.is_disconnected)
        assembler = OutputAssembler.for_turn(service, prepared, spec.conversation, "toolu_", spec.identity.agent_id)
        turn = service.start_turn(prepared)
    except (ApiError, SemanticError):
        record(None, "rejected")
        raise
    model = reply_model(body.model, request.headers)
    head = MessageHead(f"msg_{secrets.token_hex(12)}", model, len(prepared.prompt_tokens), prepared.retain_tokens,
                       omit_thinking=spec.reasoning.omitted)
    if wants_diagnostics(request.headers, body.diagnostics):
        head = _diagnosed(request, body, head, prepared.agent_id, prepared.prompt_tokens)
    if body.stream:
        return await _streamed(service, turn, assembler, head, record)
    return await _complete(request, turn, assembler, head, record)


def _diagnosed(request: Request, body: MessagesRequest, head: MessageHead, agent_id: str,
               prompt_tokens: tuple[int, ...]) -> MessageHead:
    """Compare with the request ``diagnostics.previous_message_id`` names; keep this one's fingerprint."""
    store = getattr(request.app.state, "fingerprints", None)
    if store is None:
        store = request.app.state.fingerprints = FingerprintStore()
    fields = body.model_dump(exclude_none=True, include={"model", "speed", "system", "tools", "messages",
                                                         "tool_choice", "thinking"})
    now = Fingerprint.of(agent_id, fields, prompt_tokens)
    previous_id = body.diagnostics.previous_message_id if body.diagnostics else None
    diagnostics = diagnose(store.get(previous_id), now) if previous_id else None
    store.put(head.id, now)
    return replace(head, diagnosed=True, diagnostics=diagnostics)


async def _streamed(service: EngineService, turn: AsyncTurn, assembler: OutputAssembler,
                    head: MessageHead, record: Recorder) -> Response:
    ping_s = service.settings.ping_interval_s
    try:
        opening = await first_event(turn, ping_s)
    except BaseException:
        turn.cancel()
        raise
    error = error_if_failed(opening) if isinstance(opening, FinishEvent) else None
    if error is not None:
        record(opening, None)
        raise error
    stream = MessageStream(turn, assembler, head, ping_s, record)
    return SseResponse(stream.frames(opening), stream.close,
                       headers={"request-id": turn.request_id, **cap_headers(turn.request)})


async def _complete(request: Request, turn: AsyncTurn, assembler: OutputAssembler,
                    head: MessageHead, record: Recorder) -> Response:
    finish, pieces = await run_to_end(turn, assembler, request.is_disconnected, lambda f: record(f, None))
    blocks = ContentBlocks(head.omit_thinking)
    blocks.add(pieces)
    body = message_body(head, blocks.content, finish, bool(assembler.calls))
    return JSONResponse(body, headers={"request-id": turn.request_id, **cap_headers(turn.request)})


@router.post("/v1/messages/count_tokens", summary="Count the prompt tokens of a message request",
             response_model=CountTokensResponse, responses=ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request) -> CountTokensResponse:
    tokens = await render_tokens(_service(request), conversation_of(body))
    return CountTokensResponse(input_tokens=len(tokens))


@router.get("/api/hello", summary="Claude Code's warm-up probe")
async def hello() -> dict[str, bool]:
    return {"ok": True}


# Claude Code probes /api/hello in some versions and the bare base URL (HEAD /) in others.
@router.head("/api/hello", include_in_schema=False)
@router.head("/", include_in_schema=False)
async def hello_head() -> Response:
    return Response(status_code=200)


@router.get("/", summary="What this server is")
async def root() -> dict[str, str]:
    return {"name": "semantic", "docs": "/docs", "anthropic": "/v1/messages", "openai": "/v1/chat/completions"}
