"""Everything the workbench drives that is not UI: model, engine, HTTP listener.

No Textual import here: the app calls these from its workers and event loop,
and tests can swap the engine for a scripted one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

from engine.api.listener_file import remove_listener, write_listener
from engine.api.service import EngineService
from engine.errors import SemanticError
from engine.models.gguf_import import ImportProgress
from engine.domain.event_log import EventKind, EventLog
from engine.settings import Settings

log = logging.getLogger("semantic.tui")

EngineFactory = Callable[[Settings, EventLog, Callable[[ImportProgress], None]], Any]


def real_engine_factory(settings: Settings, events: EventLog, progress: Callable[[ImportProgress], None],
                        world: Any = None) -> Any:
    """Import/load the configured model and start an engine with the warm tier (blocking); with a
    ``world`` (mlx.launch), rank 0's shard, in lockstep with the other ranks."""
    from engine.bootstrap import start_engine

    return start_engine(settings, progress, world=world, events=events)


def _real_swap_builder(settings: Settings, events: EventLog, device_turns: Any = None) -> Any:
    from engine.bootstrap import engine_builder

    return engine_builder(settings, events, device_turns)


@dataclass(slots=True)
class ListenerInfo:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class WorkbenchBackend:
    def __init__(
        self, settings: Settings, engine_factory: EngineFactory = real_engine_factory, swap_builder: Any = None
    ) -> None:
        self.settings = settings
        self.events = EventLog()
        self._swap_builder = swap_builder
        self.service = EngineService(settings, None, self.events)
        self.service.status_detail = "loading the model"
        self._factory = engine_factory
        self._server: Any = None
        self.listener: ListenerInfo | None = None

    # -- model and engine (call from a worker thread) -----------------------------------------
    def start_engine(self, progress: Callable[[ImportProgress], None]) -> Any:
        try:
            engine = self._factory(self.settings, self.events, progress)
        except SemanticError as exc:
            self.service.status_detail = f"model failed to load: {exc}"
            self.events.emit(EventKind.ERROR, self.service.status_detail, level=logging.ERROR)
            raise
        self.service.attach(engine)
        if getattr(engine.loaded, "shard", None) is None:  # a sharded model's ranks would all have to swap
            turns = getattr(engine, "device_turns", None)
            self.service.enable_swaps(self._swap_builder or _real_swap_builder(self.settings, self.events, turns))
            self.service.serve_extra_models(engine)
        return engine

    @property
    def engine(self) -> Any | None:
        return self.service._engine

    def stop_engine(self) -> None:
        if self.service.models is not None:
            self.service.models.stop_all()
        engine = self.engine
        if engine is not None and engine.is_running:
            engine.stop(self.settings.shutdown_grace_s)

    # -- the embedded HTTP listener (call from the app's event loop) ----------------------------
    async def start_http(self) -> ListenerInfo:
        from engine.api.app import create_app
        from engine.api.serve import EmbeddedServer

        self._server = EmbeddedServer(
            create_app(self.service), self.settings.host, self.settings.port, grace_s=self.settings.shutdown_grace_s
        )
        port = await self._server.start()
        listener = ListenerInfo(self.settings.host, port)
        await asyncio.to_thread(write_listener, self.settings.cache_dir, listener.url)  # for `semantic attach`
        # Set last, after the await: the app shows the address in the same step as the listener appears.
        self.listener = listener
        self.events.emit(EventKind.INFO, f"HTTP API listening on {listener.url}")
        return listener

    async def stop_http(self) -> None:
        if self._server is not None:
            await self._server.stop()
            self._server = None
            await asyncio.to_thread(remove_listener, self.settings.cache_dir)
