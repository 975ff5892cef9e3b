"""POST /v1/completions: OpenAI's text completions, the endpoint for base models.

parse (``CompletionRequest``) -> translate (``completions_translate``) ->
submit (``prepare``, as every protocol) -> translate back (a body, or the
frames of ``completions_stream``). Everything that can be rejected is
rejected before the 200 is sent, as on chat completions.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from engine.domain.requests import FinishEvent, GenerationRequest
from engine.errors import SemanticError

from .admission import SSE_HEADERS, stream_admitted
from .completion import run_to_end
from .completions_schemas import CompletionRequest, CompletionResponse
from .completions_stream import TextStream
from .completions_translate import completion_body, to_turn_spec
from .metrics import MetricsRecorder
from .openai_routes import AGENT_HEADER, RESPONSES
from .openai_schemas import STREAM_EVENT_SCHEMA
from .openai_stream import ChunkWriter
from .openai_translate import CompletionMeta
from .service import EngineService
from .turns import OutputAssembler, cap_headers, prepare

router = APIRouter(tags=["openai"])

PROTOCOL = "completions"  # (the metrics' protocol label)

COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    **RESPONSES,
    200: {"model": CompletionResponse, "description": "The completion, or with `stream: true` server-sent events",
          "content": {"text/event-stream": {"schema": STREAM_EVENT_SCHEMA}}},
}


@router.post("/v1/completions", summary="OpenAI text completions: a raw prompt continued (base models)",
             response_model=None, responses=COMPLETION_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    service: EngineService = request.app.state.service
    metrics: MetricsRecorder = request.app.state.metrics
    try:
        spec = to_turn_spec(body, request.headers, service.settings)
        generation = await prepare(service, spec, request.is_disconnected)
        meta = CompletionMeta.new(body.model or service.engine_for(generation).loaded.model_id, generation.agent_id,
                                  "cmpl")
        echo = await _echo(service, body, generation) if body.echo else ""
        turn = service.start_turn(generation)
    except SemanticError:
        metrics.observe(PROTOCOL, None, outcome="rejected")
        raise
    assembler = OutputAssembler(None)
    headers = {AGENT_HEADER: meta.agent_id, **cap_headers(generation)}
    if not body.stream:
        finish, _ = await run_to_end(turn, assembler, request.is_disconnected,
                                     lambda f: metrics.observe(PROTOCOL, f))
        return JSONResponse(completion_body(meta, echo + assembler.text, finish), headers=headers)
    ping_s = service.settings.ping_interval_s
    seen = await stream_admitted(turn, ping_s, lambda finish: metrics.observe(PROTOCOL, finish))

    def on_end(finish: FinishEvent | None) -> None:
        metrics.observe(PROTOCOL, finish, outcome=None if finish else "disconnected")

    stream = TextStream(turn, seen, assembler, ChunkWriter(meta), body.include_usage, ping_s, on_end, echo=echo)
    return StreamingResponse(stream.frames(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers},
                             background=BackgroundTask(stream.close))


async def _echo(service: EngineService, body: CompletionRequest, generation: GenerationRequest) -> str:
    """The prompt's text as ``echo`` puts it before the completion: as sent, or its token ids decoded."""
    if isinstance(body.prompt, str):
        return body.prompt
    if body.prompt and isinstance(body.prompt[0], str):
        return str(body.prompt[0])
    tokenizer = service.engine_for(generation).loaded.tokenizer
    return await service.in_thread(tokenizer.decode, list(generation.prompt_tokens))
