"""``GET /v1/stream``: one server-sent event stream for dashboards (the workbench attached to a server).

Frames: ``hello`` once (the server, the model and the stream's settings),
``stats`` at the asked interval (the body of ``GET /v1/stats``), ``log`` per
engine event (its ``id:`` is the event's sequence number, so a reconnecting
EventSource resumes with ``Last-Event-ID``), ``dropped`` before the next frame
whenever this client fell behind, and keep-alive comments during silence.
Behind the same API key as every other /v1 route (middleware.py).
"""

from __future__ import annotations

from typing import AsyncIterator, Callable

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.errors import InvalidRequestError

from .admission import KEEP_ALIVE, SSE_HEADERS
from .live_stream import StreamHub, StreamOptions, Subscriber, sse
from .service import EngineService

router = APIRouter(tags=["admin"])

KEEP_ALIVE_FRAME = KEEP_ALIVE.encode()
STREAM_EVENT_SCHEMA = {"type": "string", "description": "event: hello, then stats / log / dropped frames; never ends"}
ERROR_SCHEMA = {"type": "object", "required": ["type", "error"],
                "properties": {"type": {"const": "error"}, "error": {"type": "object"}}}


class LiveStreamResponse(StreamingResponse):
    """A streaming response that lets go of its subscriber however it ends: the client leaving, the
    server closing the stream, or a failure before the first byte (where the body's own ``finally``
    would never run, because it never started)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def resume_after(after: int | None, last_event_id: str | None) -> int | None:
    """Where the log resumes: Last-Event-ID (an EventSource reconnecting) wins over ``after``."""
    if last_event_id is None or not last_event_id.strip():
        return after
    value = last_event_id.strip()
    if not value.isdigit():
        raise InvalidRequestError(f"Last-Event-ID must be a log sequence number, got {value[:40]!r}",
                                  field="Last-Event-ID")
    return int(value)


def hello_frame(request: Request, hub: StreamHub, options: StreamOptions) -> bytes:
    service: EngineService = request.app.state.service
    snapshot = service.snapshot()
    model = snapshot.model if snapshot is not None else None
    return sse("hello", {
        "server": "semantic", "version": request.app.version,
        "model": model.model_id if model is not None else None,
        "identity": model.identity if model is not None else None,
        "interval_s": options.interval_s, "blocks": options.blocks, "after": options.after,
        "log_seq": hub.cursor, "log_buffer": hub.log_bound,
        "keepalive_s": service.settings.ping_interval_s, "max_clients": hub.max_clients,
    })


async def frames(subscriber: Subscriber, hello: bytes, keepalive_s: float) -> AsyncIterator[bytes]:
    yield hello
    while not subscriber.closed:
        if not await subscriber.wait(keepalive_s):
            yield KEEP_ALIVE_FRAME
            continue
        chunk = subscriber.take()
        if chunk:
            yield chunk


@router.get(
    "/v1/stream",
    summary="Live stream for dashboards: stats at an interval and engine events as they happen (SSE)",
    response_class=StreamingResponse,
    responses={
        200: {"description": "Server-sent events that never end (docs/api.md, 'Live stream')",
              "content": {"text/event-stream": {"schema": STREAM_EVENT_SCHEMA}}},
        400: {"description": "A parameter out of range", "content": {"application/json": {"schema": ERROR_SCHEMA}}},
        429: {"description": "stream_max_clients clients already",
              "content": {"application/json": {"schema": ERROR_SCHEMA}}},
    },
)
async def live_stream(
    request: Request,
    interval: float = Query(0.5, ge=0.1, le=10, description="Seconds between stats frames"),
    blocks: bool = Query(True, description="Stats frames carry the pool's per-block map (pool.block_map), "
                                           "as /v1/stats?blocks=true"),
    after: int | None = Query(None, ge=0, description="Resume the log: first send the events after this "
                                                      "sequence number that the server still holds (0: all)"),
    last_event_id: str | None = Header(None, description="Sent by a reconnecting EventSource; wins over after"),
) -> StreamingResponse:
    service: EngineService = request.app.state.service
    hub: StreamHub = request.app.state.stream_hub
    options = StreamOptions(interval, blocks, resume_after(after, last_event_id))
    subscriber = hub.subscribe(options)
    try:
        hello = hello_frame(request, hub, options)
    except BaseException:
        hub.unsubscribe(subscriber)
        raise
    return LiveStreamResponse(frames(subscriber, hello, service.settings.ping_interval_s),
                              on_close=lambda: hub.unsubscribe(subscriber))
