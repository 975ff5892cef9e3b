"""Bridge from the engine thread's event sink to an asyncio consumer.

The engine calls the sink on its own thread; ``call_soon_threadsafe`` hands
each event to the event loop, so no request ever blocks the loop on MLX work.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from engine.runtime.engine_thread.engine import Engine
from engine.domain.requests import EngineEvent, FinishEvent, FinishReason, GenerationRequest


class AsyncTurn:
    def __init__(self, engine: Engine, request: GenerationRequest,
                 on_finish: Callable[[], None] | None = None) -> None:
        """``on_finish``: called on the event loop when the engine ends the turn, whether or not anyone
        still reads its events (a client gone mid-stream)."""
        self.engine = engine
        self.request = request
        self.finish: FinishEvent | None = None
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._on_finish = on_finish
        loop = asyncio.get_running_loop()
        engine.submit(request, lambda event: loop.call_soon_threadsafe(self._arrived, event))

    def _arrived(self, event: EngineEvent) -> None:
        self._queue.put_nowait(event)
        if isinstance(event, FinishEvent) and self._on_finish is not None:
            on_finish, self._on_finish = self._on_finish, None
            on_finish()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def next_event(self, timeout_s: float | None = None) -> EngineEvent | None:
        """The next event, or None after ``timeout_s`` without one (time for a ping)."""
        try:
            event = await asyncio.wait_for(self._queue.get(), timeout_s)
        except asyncio.TimeoutError:
            return None
        if isinstance(event, FinishEvent):
            self.finish = event
        return event

    async def events(self, ping_every_s: float | None = None) -> AsyncIterator[EngineEvent | None]:
        """Every event until the finish; None marks ``ping_every_s`` of silence."""
        while self.finish is None:
            yield await self.next_event(ping_every_s)

    def cancel(self) -> None:
        if self.finish is None:
            self.engine.cancel(self.request_id, FinishReason.CANCELLED)

    async def run_to_finish(self, disconnected: Callable[[], Awaitable[bool]], poll_s: float = 0.5) -> list[EngineEvent]:
        """Collect every event (non-streaming responses), cancelling if the client goes away."""
        collected: list[EngineEvent] = []
        loop = asyncio.get_running_loop()
        # Checked on a clock, not only on silence: a steady token stream would
        # otherwise never look, and a gone client would hold the batch slot.
        next_check = loop.time() + poll_s
        while self.finish is None:
            event = await self.next_event(poll_s)
            if event is not None:
                collected.append(event)
            if loop.time() >= next_check and self.finish is None:
                next_check = loop.time() + poll_s
                if await disconnected():
                    self.cancel()
        return collected
