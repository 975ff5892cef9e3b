"""Starting a turn so that failures at admission still get an honest HTTP status.

The engine reports pool exhaustion as an error FinishEvent right after the
QueuedEvent, before any prefill. A streaming handler that sent its 200 at
once could only report it as an in-stream error, which clients do not retry;
waiting for the admission decision first turns it into a 429 with
``retry-after``. The wait is capped at one ping interval so a turn queued
behind others still starts its stream (and its keep-alives) in time.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from engine.domain.requests import EngineEvent, FinishEvent, FinishReason, PrefillEvent, TokenEvent

from .async_turn import AsyncTurn
from .errors import ApiError

# Events after which the engine has decided: the turn runs, or it has failed.
_DECISIVE = (PrefillEvent, TokenEvent, FinishEvent)

# Bytes the client sees during silence (a long prefill); SSE comment lines are ignored by parsers.
KEEP_ALIVE = ": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def failed(finish: FinishEvent) -> bool:
    return finish.reason in (FinishReason.ERROR, FinishReason.CANCELLED)


def finish_error(finish: FinishEvent) -> ApiError:
    """The HTTP error for a turn that ended in failure."""
    if finish.error_type == "rate_limit":
        return ApiError(429, finish.error or "KV pool exhausted", retry_after_s=finish.retry_after_s or 1)
    if finish.error_type == "overloaded":
        return ApiError(529, finish.error or "the server is overloaded", retry_after_s=finish.retry_after_s or 5)
    if finish.reason is FinishReason.CANCELLED:
        return ApiError(503, "the generation was cancelled (server stopping or swapping models)", retry_after_s=5)
    return ApiError(500, f"generation failed: {finish.error or 'unknown engine error'}")


async def await_admission(turn: AsyncTurn, wait_s: float) -> list[EngineEvent]:
    """Events up to the admission decision (or ``wait_s``); raises ApiError when the turn failed there."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    seen: list[EngineEvent] = []
    while (left := deadline - loop.time()) > 0:
        event = await turn.next_event(left)
        if event is None:
            break
        seen.append(event)
        if isinstance(event, FinishEvent) and failed(event):
            raise finish_error(event)
        if isinstance(event, _DECISIVE):
            break
    return seen


async def replay(seen: list[EngineEvent], turn: AsyncTurn, ping_s: float) -> AsyncIterator[EngineEvent | None]:
    """The events already read during admission, then the rest (None marks a ping interval of silence)."""
    for event in seen:
        yield event
    async for event in turn.events(ping_s):
        yield event


async def stream_admitted(turn: AsyncTurn, wait_s: float,
                          observe: Callable[[FinishEvent | None], None]) -> list[EngineEvent]:
    """:func:`await_admission` for a route about to stream: a turn that failed there is counted (``observe``: the
    protocol's metrics) before its error is answered; anything else that ends the wait (the client went away, the
    handler was cancelled) cancels the turn."""
    try:
        return await await_admission(turn, wait_s)
    except ApiError:
        observe(turn.finish)
        raise
    except BaseException:
        turn.cancel()
        raise
