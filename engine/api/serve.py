"""Serving the API with uvicorn: headless (``semantic --serve``) or inside an
event loop that already runs (the workbench).

Shutdown order matters: stop accepting, let in-flight streams finish while
the engine still runs, then stop the engine (which cancels what is left and
writes hot caches to the warm tier). Stopping the engine first would cut
every stream short; stopping HTTP without a deadline could wait forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from typing import Any, Awaitable, Callable, Iterator

import uvicorn

from engine.errors import SemanticError
from engine.models.gguf_import import ImportProgress
from engine.bootstrap import engine_builder, release_mlx
from engine.distributed.launcher_watch import STOP_SIGNALS, launcher_pid, watch_launcher
from engine.settings import Settings

from .listener_file import remove_listener, write_listener
from .service import EngineService

log = logging.getLogger("semantic.serve")

# After the grace period the engine cancels the remaining turns; their streams
# then need a moment to write the final events before uvicorn cuts them off.
FLUSH_S = 2.0

EngineFactory = Callable[[Settings, Callable[[ImportProgress], None]], Any]


class _Server(uvicorn.Server):
    """uvicorn minus its signal handling, plus an event for "listening".

    uvicorn's own handlers would take SIGINT from the workbench, and after a
    graceful exit re-raise the signal, which turns a clean SIGTERM shutdown
    into exit status -15; whoever owns the loop decides what signals mean.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()


class EmbeddedServer:
    """uvicorn as a task of the running loop: ``await start()`` returns the bound port."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        grace_s: float = 10.0,
        on_grace_expired: Callable[[], Awaitable[None]] | None = None,
        access_log: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.grace_s = grace_s
        self._on_grace_expired = on_grace_expired
        # log_config=None: records propagate to the process's handlers (JSON lines, the TUI's log).
        self._config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=access_log, lifespan="off",
                                      timeout_graceful_shutdown=grace_s + FLUSH_S)  # type: ignore[arg-type]
        self._server = _Server(self._config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def in_flight(self) -> int:
        """Requests whose handlers are still running."""
        return len(self._server.server_state.tasks)

    async def start(self) -> int:
        """Bind (OSError when the address is taken), serve, and return the port once listening."""
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._serve(sock), name=f"semantic-http-{self.port}")
        listening = asyncio.create_task(self._server.listening.wait())
        await asyncio.wait({self._task, listening}, return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            listening.cancel()
            self._task.result()
            raise RuntimeError("the HTTP server exited during start-up")
        return self.port

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await self._server.serve(sockets=[sock])
        except SystemExit as exc:
            # uvicorn exits the process on a failed start-up; here that would end the caller's loop.
            raise RuntimeError(f"the HTTP server failed to start (status {exc.code})") from None
        finally:
            sock.close()

    async def stop(self) -> None:
        """Stop accepting; give in-flight requests ``grace_s``, then ``on_grace_expired``, then cancel."""
        if self._task is None:
            return
        self._server.should_exit = True
        hub = getattr(getattr(self._config.app, "state", None), "stream_hub", None)
        if hub is not None:  # live streams never end by themselves: they would hold the exit to its deadline
            hub.close()
        done, _ = await asyncio.wait({self._task}, timeout=self.grace_s)
        if not done:
            log.warning("%d request(s) still running after %.1f s; cancelling them", self.in_flight, self.grace_s)
            if self._on_grace_expired is not None:
                await self._on_grace_expired()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        writer = getattr(getattr(self._config.app, "state", None), "trace_writer", None)
        if writer is not None:  # the request recorder's last lines
            await asyncio.to_thread(writer.close)

    def force_exit(self) -> None:
        """Stop waiting for in-flight requests (a second Ctrl+C)."""
        self._server.should_exit = True
        self._server.force_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(address, family=family, backlog=2048)


# -- headless ------------------------------------------------------------------------------


class ProgressLog:
    """Model import/load progress as one log line when a stage starts and one when it ends."""

    def __init__(self) -> None:
        self._started: dict[str, float] = {}
        self._finished: set[str] = set()

    def __call__(self, update: ImportProgress) -> None:
        stage = update.stage
        if stage not in self._started:
            self._started[stage] = time.monotonic()
            log.info("model %s: started", stage, extra={"stage": stage, "total": update.total})
        if update.total and update.done >= update.total and stage not in self._finished:
            self._finished.add(stage)
            elapsed = time.monotonic() - self._started[stage]
            log.info("model %s: done in %.1f s", stage, elapsed, extra={"stage": stage})


def start_configured_engine(settings: Settings, progress: Callable[[ImportProgress], None]) -> Any:
    """Import if needed, load, build and start the engine (blocking; runs in a worker thread)."""
    from engine.bootstrap import start_engine

    return start_engine(settings, progress)


def serve_headless(settings: Settings, engine_factory: EngineFactory = start_configured_engine) -> int:
    """``semantic --serve``: the API answers (not ready) while the model loads; SIGINT/SIGTERM/SIGHUP exit 0."""
    run = HeadlessRun(settings, engine_factory)
    status = asyncio.run(run.run())
    del run
    release_mlx()
    return status


class HeadlessRun:
    def __init__(self, settings: Settings, engine_factory: EngineFactory) -> None:
        from .app import create_app

        self.settings = settings
        self.factory = engine_factory
        self.service = EngineService(settings, None)
        self.service.status_detail = "loading the model"
        self.exit_requested = asyncio.Event()
        self.failure: BaseException | None = None
        self.server = EmbeddedServer(create_app(self.service), settings.host, settings.port,
                                     grace_s=settings.shutdown_grace_s, on_grace_expired=self._stop_engine,
                                     access_log=True)

    async def run(self) -> int:
        try:
            await self.server.start()
        except (OSError, RuntimeError) as exc:
            log.error("cannot listen on %s:%s: %s", self.settings.host, self.settings.port, exc)
            return 1
        log.info("listening on %s", self.server.url, extra={"url": self.server.url, "port": self.server.port})
        await asyncio.to_thread(write_listener, self.settings.cache_dir, self.server.url)
        with self._signals(), self._launcher_watched():
            engine = await self._load()
            if engine is not None and not self.exit_requested.is_set():
                self._announce(engine)
                await self.exit_requested.wait()
            await self.server.stop()
            await asyncio.to_thread(remove_listener, self.settings.cache_dir)
            await self._stop_engine()
        return 0 if engine is not None and self.failure is None else 1

    async def _load(self) -> Any | None:
        loading = asyncio.ensure_future(asyncio.to_thread(self.factory, self.settings, ProgressLog()))
        exit_wait = asyncio.ensure_future(self.exit_requested.wait())
        await asyncio.wait({loading, exit_wait}, return_when=asyncio.FIRST_COMPLETED)
        exit_wait.cancel()
        if not loading.done():
            log.info("waiting for the model load to finish before exiting (it cannot be interrupted)")
        try:
            engine = await loading
        except Exception as exc:
            # One line at error level; a library's own exception (not a
            # SemanticError) says what it is, and its traceback is for --log-level debug.
            reason = str(exc) if isinstance(exc, SemanticError) else f"{type(exc).__name__}: {exc}"
            log.error("model failed to load: %s", reason)
            log.debug("model load failure", exc_info=exc)
            self.service.status_detail = f"model failed to load: {reason}"
            return None
        self.service.events = engine.events
        self.service.attach(engine)
        if engine.loaded.shard is None:  # a sharded model's ranks would all have to swap together
            self.service.enable_swaps(engine_builder(self.settings, engine.events, getattr(engine, "device_turns", None)))
            self.service.serve_extra_models(engine)
        self._watch_failure(engine)
        return engine

    def _watch_failure(self, engine: Any) -> None:
        """An engine that stops on its own (a sharded model lost a rank) ends the run, non-zero."""
        loop = asyncio.get_running_loop()

        def failed(exc: BaseException) -> None:
            loop.call_soon_threadsafe(self._engine_failed, exc)

        engine.on_failure = failed
        if getattr(engine, "failure", None) is not None:
            self._engine_failed(engine.failure)

    def _engine_failed(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            log.error("the engine stopped: %s; shutting down", exc)
        self.exit_requested.set()

    def _announce(self, engine: Any) -> None:
        loaded = engine.loaded
        log.info("ready: %s (%s, context %d)", loaded.model_id, loaded.identity.key, engine.context_length,
                 extra={"model": loaded.model_id, "url": self.server.url})
        log.info("Claude Code: ANTHROPIC_BASE_URL=%s claude", self.server.url)

    async def _stop_engine(self) -> None:
        """Cancel what still runs and persist hot caches; a no-op once stopped."""
        if self.service.models is not None:
            await asyncio.to_thread(self.service.models.stop_all)
        if self.service.is_ready:
            engine = self.service.engine
            log.info("stopping the engine (hot caches go to the warm tier)")
            await asyncio.to_thread(engine.stop, 0.0)

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    @contextlib.contextmanager
    def _launcher_watched(self) -> Iterator[None]:
        """Under ``mlx.launch``: a launcher that ends (SIGTERM, SIGKILL) stops this rank as SIGTERM would,
        and rank 0's end of the run stops the others (engine/distributed/launcher_watch.py)."""
        launcher = launcher_pid()
        if launcher is None:
            yield
            return
        loop = asyncio.get_running_loop()
        stop = watch_launcher(launcher, lambda: loop.call_soon_threadsafe(self._launcher_gone))
        try:
            yield
        finally:
            stop.set()

    def _launcher_gone(self) -> None:
        if not self.exit_requested.is_set():
            log.info("shutting down: the launcher is gone (in-flight requests get %.1f s)",
                     self.settings.shutdown_grace_s)
            self.exit_requested.set()

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.exit_requested.is_set():
            log.warning("%s again: not waiting for in-flight requests", name)
            self.server.force_exit()
            return
        log.info("%s: shutting down (in-flight requests get %.1f s)", name, self.settings.shutdown_grace_s)
        self.exit_requested.set()
