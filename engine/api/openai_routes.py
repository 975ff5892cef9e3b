"""POST /v1/chat/completions: the OpenAI-compatible endpoint.

Everything that can be rejected (validation, a prompt longer than the
context, pool exhaustion at admission) is rejected before the 200 is sent,
so clients see a real status code they know how to handle.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from engine.domain.requests import FinishEvent
from engine.errors import SemanticError

from .admission import SSE_HEADERS, stream_admitted
from .async_turn import AsyncTurn
from .completion import run_to_end
from .metrics import MetricsRecorder
from .openai_schemas import (
    STREAM_EVENT_SCHEMA,
    ChatCompletionRequest,
    ChatCompletionResponse,
    OpenAIErrorResponse,
)
from .openai_stream import ChatStream, ChunkWriter
from .openai_translate import CompletionMeta, completion_body, to_turn_spec
from .service import EngineService
from .turns import OutputAssembler, cap_headers, prepare

router = APIRouter(tags=["openai"])

AGENT_HEADER = "x-semantic-agent-id"

RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ChatCompletionResponse, "description": "The completion, or with `stream: true` server-sent events",
          "content": {"text/event-stream": {"schema": STREAM_EVENT_SCHEMA}}},
    **{status: {"model": OpenAIErrorResponse, "description": description} for status, description in (
        (400, "Invalid request (also: prompt is too long)"),
        (429, "No room in the KV pool now; see retry-after"),
        (500, "Generation failed"),
        (503, "No model loaded, or generation cancelled"),
    )},
}


@router.post("/v1/chat/completions", summary="OpenAI chat completions (streaming and non-streaming)",
             response_model=None, responses=RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    service: EngineService = request.app.state.service
    metrics: MetricsRecorder = request.app.state.metrics
    try:
        spec = to_turn_spec(body, request.headers, service.settings)
        generation = await prepare(service, spec, request.is_disconnected)
        meta = CompletionMeta.new(body.model or service.engine_for(generation).loaded.model_id, generation.agent_id)
        assembler = OutputAssembler.for_turn(service, generation, spec.conversation, "call_", spec.identity.agent_id)
        turn = service.start_turn(generation)
    except SemanticError:
        metrics.observe("openai", None, outcome="rejected")
        raise
    if body.stream:
        return await _streamed(request, turn, assembler, meta, body.include_usage)
    return await _complete(request, turn, assembler, meta)


async def _complete(request: Request, turn: AsyncTurn, assembler: OutputAssembler, meta: CompletionMeta) -> Response:
    finish, _ = await run_to_end(turn, assembler, request.is_disconnected,
                                 lambda f: request.app.state.metrics.observe("openai", f))
    body = completion_body(meta, assembler.text, assembler.calls, finish, assembler.reasoning)
    return JSONResponse(body, headers={AGENT_HEADER: meta.agent_id, **cap_headers(turn.request)})


async def _streamed(
    request: Request, turn: AsyncTurn, assembler: OutputAssembler, meta: CompletionMeta, include_usage: bool,
) -> Response:
    metrics: MetricsRecorder = request.app.state.metrics
    ping_s = request.app.state.service.settings.ping_interval_s
    seen = await stream_admitted(turn, ping_s, lambda finish: metrics.observe("openai", finish))

    def on_end(finish: FinishEvent | None) -> None:
        metrics.observe("openai", finish, outcome=None if finish else "disconnected")

    stream = ChatStream(turn, seen, assembler, ChunkWriter(meta), include_usage, ping_s, on_end)
    return StreamingResponse(
        stream.frames(),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, AGENT_HEADER: meta.agent_id, **cap_headers(turn.request)},
        background=BackgroundTask(stream.close),
    )
