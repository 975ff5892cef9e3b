"""The real HTTP API on the real SmolLM2, for tests that use real clients.

``running_api`` builds an engine the way ``semantic --serve`` does
(``build_engine`` from settings, warm tier included), wraps it in the full
``create_app`` and serves it with uvicorn on a free port in a background
thread. Extra apps can share the engine (``extra_app``): an app is cheap,
the engine is what takes memory and a thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
from fastapi import FastAPI

from engine.api.app import create_app
from engine.api.service import EngineService
from engine.bootstrap import build_engine
from engine.models.loaded import LoadedModel
from engine.runtime.engine_thread.engine import Engine
from engine.settings import Settings
from tests.support.router_app import LiveServer

# Small enough for CPU, large enough that batching and block reuse are exercised. No API key
# unless a test sets one: a developer's SEMANTIC_API_KEY or config file must not leak in.
SERVER_SETTINGS: dict[str, Any] = {"max_batch_size": 16, "pool_budget_mb": 512, "ping_interval_s": 2.0,
                                   "api_key": None}


def real_settings(cache_dir: Path, model_path: Path, **overrides: Any) -> Settings:
    # Settings(...) rather than load_settings: init values, None included, outrank the environment.
    return Settings(cache_dir=cache_dir, model=str(model_path), **{**SERVER_SETTINGS, **overrides})


@dataclass
class RealApi:
    """A started engine and the live server in front of it."""

    engine: Engine
    settings: Settings
    server: LiveServer
    app: FastAPI

    @property
    def url(self) -> str:
        return self.server.url

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/stats", timeout=30)
        response.raise_for_status()
        return response.json()

    def event_lines(self) -> list[str]:
        return [f"{e.kind.value:7} {e.message}" for e in self.engine.events.since(0)]

    def held_tokens(self, agent_id: str) -> tuple[int, ...]:
        """The tokens ``agent_id``'s cache holds now (none for an agent the engine does not know)."""
        def held(engine: Engine) -> tuple[int, ...]:
            agent = engine.agents.get(agent_id)
            return tuple(agent.tokens) if agent is not None else ()
        return self.engine.call(held).result(30)


@contextlib.contextmanager
def running_api(
    loaded: LoadedModel, cache_dir: Path, model_path: Path,
    configure: Callable[[FastAPI], None] | None = None, **settings: Any,
) -> Iterator[RealApi]:
    """Engine + app + server; ``configure`` may add middleware before the first request."""
    config = real_settings(cache_dir, model_path, **settings)
    engine = build_engine(config, loaded)
    engine.start()
    try:
        app = create_app(EngineService(config, engine))
        if configure is not None:
            configure(app)
        try:
            with LiveServer(app) as server:
                yield RealApi(engine, config, server, app)
        finally:
            writer = getattr(app.state, "trace_writer", None)
            if writer is not None:  # --record-requests: the last lines reach the file
                writer.close()
    finally:
        # Zero grace: every test waited for its own responses already.
        engine.stop(0.0)


@contextlib.contextmanager
def extra_app(api: RealApi, **settings: Any) -> Iterator[LiveServer]:
    """A second app with other settings (an API key) around the same running engine."""
    config = api.settings.model_copy(update=settings)
    with LiveServer(create_app(EngineService(config, api.engine))) as server:
        yield server


@dataclass
class StatsPoller:
    """Polls /v1/stats in a thread and keeps the largest decode batch it saw.

    The engine republishes its snapshot a few times a second; polling faster
    than that costs little and cannot miss a batch that lasts a few steps.
    """

    url: str
    interval_s: float = 0.1
    max_batch: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "StatsPoller":
        self._thread = threading.Thread(target=self._run, name="stats-poller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.is_set():
                throughput = client.get("/v1/stats").json()["throughput"]
                self.max_batch = max(self.max_batch, throughput["batch_size"])
                self.samples += 1
                self._stop.wait(self.interval_s)


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll until ``condition()`` is truthy and return it; AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
