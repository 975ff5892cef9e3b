"""The OpenAI Responses API: ``POST /v1/responses`` and the stored responses.

What Codex CLI speaks to a custom provider. A turn is an agent's turn like
any other: rendered, matched against the agent's cache, prefilled only past
it. Everything that can be rejected (a bad item, an unknown
``previous_response_id``, a bad tool schema, pool exhaustion) is rejected
before the 200, in OpenAI's error shape, and nothing is stored for it; a
prompt longer than the context is a 400 with ``code:
context_length_exceeded``, or, for a streaming request, a ``response.failed``
event with that code (what Codex reads as a full context window).

A response is stored (``store``, true by default) after it finished and
before its last byte goes out, on a worker thread; a failed or cancelled
turn stores nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from engine.domain.requests import FinishEvent
from engine.errors import PromptTooLongError, SemanticError
from engine.store.stored_responses import ResponseStore, StoredResponse

from .admission import SSE_HEADERS, stream_admitted
from .async_turn import AsyncTurn
from .completion import run_to_end
from .errors import ApiError, from_domain
from .metrics import MetricsRecorder
from .openai_routes import AGENT_HEADER
from .openai_schemas import OpenAIErrorResponse
from .responses_items import Item, input_items
from .responses_schemas import (
    STREAM_EVENT_SCHEMA,
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from .responses_stream import EventWriter, ResponseStream, failed_before_start
from .responses_translate import ResponseMeta, outcome, output_items, to_turn_spec
from .service import EngineService
from .turns import OutputAssembler, cap_headers, prepare

router = APIRouter(tags=["openai"])

PROTOCOL = "responses"

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": OpenAIErrorResponse, "description": description} for status, description in (
        (400, "Invalid request (a prompt longer than the context: code context_length_exceeded)"),
        (404, "previous_response_id names no stored response"),
        (429, "No room in the KV pool now; see retry-after"),
        (500, "Generation failed"),
        (503, "No model loaded, or generation cancelled"),
    )
}
CREATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ResponseObject, "description": "The response, or with `stream: true` server-sent events",
          "content": {"text/event-stream": {"schema": STREAM_EVENT_SCHEMA}}},
    **ERRORS,
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": OpenAIErrorResponse, "description": "No stored response has this id"}}


def response_store(request: Request) -> ResponseStore:
    """The app's store, made on first use (its directory follows the service's settings)."""
    store = getattr(request.app.state, "responses", None)
    if store is None:
        settings = request.app.state.service.settings
        store = ResponseStore(settings.cache_dir / "responses", settings.stored_responses_kept)
        request.app.state.responses = store
    return store


async def _stored(request: Request, response_id: str, param: str | None = None) -> StoredResponse:
    found = await asyncio.to_thread(response_store(request).get, response_id)
    if found is None:
        raise ApiError(404, f"no stored response with id {response_id!r}", param=param)
    return found


@router.post("/v1/responses", summary="OpenAI Responses API (streaming and non-streaming)",
             response_model=None, responses=CREATE_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    service: EngineService = request.app.state.service
    metrics: MetricsRecorder = request.app.state.metrics
    try:
        items = input_items(body.input)
        previous = None
        if body.previous_response_id:
            previous = await _stored(request, body.previous_response_id, "previous_response_id")
        spec = to_turn_spec(body, items, previous, request.headers, service.settings)
        try:
            generation = await prepare(service, spec, request.is_disconnected)
        except PromptTooLongError as exc:
            if not body.stream:
                raise
            meta = ResponseMeta.new(body, service.loaded.model_id, spec.identity.agent_id)
            metrics.observe(PROTOCOL, None, outcome="rejected")
            return StreamingResponse(failed_before_start(meta, from_domain(exc)), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, AGENT_HEADER: meta.agent_id})
        meta = ResponseMeta.new(body, service.engine_for(generation).loaded.model_id, generation.agent_id)
        assembler = OutputAssembler.for_turn(service, generation, spec.conversation, "call_", spec.identity.agent_id)
        turn = service.start_turn(generation)
    except (SemanticError, ApiError):
        metrics.observe(PROTOCOL, None, outcome="rejected")
        raise
    history = [*(previous.history if previous else ()), *items]

    async def settle(response: dict[str, Any], output: list[Item]) -> None:
        if body.store:
            record = StoredResponse(meta.id, meta.agent_id, meta.created_at, response, items, [*history, *output])
            await asyncio.to_thread(response_store(request).put, record)

    if body.stream:
        return await _streamed(request, turn, assembler, meta, settle)
    return await _complete(request, turn, assembler, meta, settle)


async def _complete(request: Request, turn: AsyncTurn, assembler: OutputAssembler, meta: ResponseMeta,
                    settle: Any) -> Response:
    finish, _ = await run_to_end(turn, assembler, request.is_disconnected,
                                 lambda f: request.app.state.metrics.observe(PROTOCOL, f))
    status, reason = outcome(finish, bool(assembler.calls))
    output = output_items(assembler.text, assembler.calls, status, assembler.reasoning,
                          meta.request.includes_encrypted_reasoning)
    body = meta.body(status, output, finish.usage, reason)
    await settle(body, output)
    return JSONResponse(body, headers={AGENT_HEADER: meta.agent_id, **cap_headers(turn.request)})


async def _streamed(request: Request, turn: AsyncTurn, assembler: OutputAssembler, meta: ResponseMeta,
                    settle: Any) -> Response:
    metrics: MetricsRecorder = request.app.state.metrics
    ping_s = request.app.state.service.settings.ping_interval_s
    seen = await stream_admitted(turn, ping_s, lambda finish: metrics.observe(PROTOCOL, finish))

    def on_end(finish: FinishEvent | None) -> None:
        metrics.observe(PROTOCOL, finish, outcome=None if finish else "disconnected")

    stream = ResponseStream(turn, seen, assembler, EventWriter(meta), ping_s, settle, on_end)
    return StreamingResponse(
        stream.frames(),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, AGENT_HEADER: meta.agent_id, **cap_headers(turn.request)},
        background=BackgroundTask(stream.close),
    )


# -- stored responses ---------------------------------------------------------------------------
@router.get("/v1/responses/{response_id}", summary="A stored response", response_model=None,
            responses={200: {"model": ResponseObject, "description": "The response as it was returned"}, **NOT_FOUND})
async def get_response(response_id: str, request: Request) -> Response:
    # As stored, byte for byte the object the client got (a response model would drop the usage extension).
    return JSONResponse((await _stored(request, response_id)).response)


@router.delete("/v1/responses/{response_id}", summary="Delete a stored response (its agent and cache stay)",
               response_model=DeletedResponse, responses=NOT_FOUND)
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not await asyncio.to_thread(response_store(request).delete, response_id):
        raise ApiError(404, f"no stored response with id {response_id!r}")
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", summary="The input items of a stored response",
            response_model=InputItemList, responses=NOT_FOUND)
async def list_input_items(
    response_id: str, request: Request,
    after: str | None = Query(None, description="List the items after this item id"),
    limit: int = Query(20, ge=1, le=100),
    order: str = Query("desc", pattern="^(asc|desc)$"),
) -> dict[str, Any]:
    items = list((await _stored(request, response_id)).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise ApiError(400, f"after names no input item of {response_id!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
