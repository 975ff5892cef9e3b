"""What the HTTP layer (and the workbench) hold on to: the running engine and its settings.

The engine behind the service can be replaced by a model swap; every request
picks up the current one when it starts and keeps it until it finishes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, TypeVar

from engine.errors import EngineUnavailableError
from engine.models.loaded import LoadedModel
from engine.runtime.engine import Engine
from engine.runtime.event_log import EventLog
from engine.runtime.requests import GenerationRequest
from engine.runtime.snapshot import EngineSnapshot
from engine.settings import Settings

from .async_turn import AsyncTurn

T = TypeVar("T")


class EngineService:
    def __init__(self, settings: Settings, engine: Engine | None, events: EventLog | None = None) -> None:
        self.settings = settings
        self.events = events or (engine.events if engine is not None else EventLog())
        self._engine = engine
        self.started_at = time.time()
        self.status_detail: str | None = None

    # -- the current engine ------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        if self._engine is None or not self._engine.is_running:
            raise EngineUnavailableError(self.status_detail or "no model is loaded yet", retry_after_s=5)
        return self._engine

    def attach(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def is_ready(self) -> bool:
        return self._engine is not None and self._engine.is_running

    @property
    def loaded(self) -> LoadedModel:
        return self.engine.loaded

    def snapshot(self) -> EngineSnapshot | None:
        return self._engine.snapshot() if self._engine is not None else None

    # -- work --------------------------------------------------------------------------------
    def start_turn(self, request: GenerationRequest) -> AsyncTurn:
        return AsyncTurn(self.engine, request)

    async def call(self, fn: Callable[[Engine], T], timeout_s: float = 30.0) -> T:
        """Run ``fn(engine)`` on the engine thread and await its result."""
        future = self.engine.call(fn)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU work that must not block the event loop (tokenizing a long prompt)."""
        return await asyncio.to_thread(fn, *args)
