"""Apps for API tests: a ScriptedEngine behind an EngineService, served by
the full ``create_app`` when every router module exists, else by a bare app
with the same error handlers, state and the routers that do exist.

Also a real uvicorn server on a free port, for clients that need a socket
(the synchronous OpenAI SDK) and for client disconnects.
"""

from __future__ import annotations

import importlib
import socket
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

import uvicorn
from fastapi import FastAPI

from engine.api import app as app_module
from engine.api.metrics import MetricsRecorder
from engine.api.service import EngineService
from engine.settings import Settings
from tests.support.scripted_engine import ScriptedEngine

ROUTER_MODULES = ("anthropic_routes", "openai_routes", "models_routes", "agents_routes", "admin_routes", "health_routes")


def make_service(cache_dir: Path, engine: ScriptedEngine | None = None, **settings: object) -> EngineService:
    values = {"cache_dir": cache_dir, "ping_interval_s": 0.05, **settings}
    return EngineService(Settings(**values), engine or ScriptedEngine())  # type: ignore[arg-type]


def build_app(service: EngineService) -> FastAPI:
    routers = [_module(name) for name in ROUTER_MODULES]
    if all(routers):
        return app_module.create_app(service)
    app = FastAPI()
    app.state.service = service
    app.state.metrics = MetricsRecorder(service)
    app_module._install_error_handlers(app)
    for module in routers:
        if module is not None:
            app.include_router(module.router)
    return app


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"engine.api.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"engine.api.{name}":
            raise
        return None


class LiveServer:
    """uvicorn in a background thread on an ephemeral port."""

    def __init__(self, app: FastAPI, port: int = 0, send_buffer: int | None = None) -> None:
        """``port``: 0 for an ephemeral one; a port an earlier server used, to stand in for its restart.
        ``send_buffer``: SO_SNDBUF of every connection (Linux hands the listening socket's to them), so a
        client that stops reading blocks the server's writes after kilobytes rather than megabytes."""
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer is not None:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self._socket.bind(("127.0.0.1", port))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(5)
        self._socket.close()


def live_server(app: FastAPI) -> Iterator[LiveServer]:
    with LiveServer(app) as server:
        yield server


def tiny_llama_api(cache_dir: Path) -> Iterator[str]:
    """The whole HTTP API over a real engine on a tiny random-weight llama (byte tokenizer): its base URL.
    (For module fixtures: ``yield from tiny_llama_api(tmp_path_factory.mktemp(...))``.)"""
    from engine.api.app import create_app
    from engine.runtime.engine_thread.engine import Engine
    from tests.support.engine_settings import engine_settings
    from tests.support.tiny_models import loaded_tiny

    engine = Engine(loaded_tiny("llama", block_tokens=16), engine_settings(64 * 2**20, 8, 32))
    engine.start()
    try:
        with LiveServer(create_app(make_service(cache_dir, engine))) as server:  # type: ignore[arg-type]
            yield server.url
    finally:
        engine.stop(0.0)
