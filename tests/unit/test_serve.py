"""Serving over real sockets with a ScriptedEngine: EmbeddedServer's start and
graceful stop inside a running loop, and the headless run's shutdown order
(streams drain first, then the engine stops), in-process and as a process
that gets SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.api.app import create_app
from engine.api.serve import FLUSH_S, EmbeddedServer, HeadlessRun, ProgressLog
from engine.errors import ModelLoadError
from engine.models.gguf_import import ImportProgress
from engine.settings import Settings
from tests.support.router_app import make_service
from tests.support.scripted_engine import ScriptedEngine

REPO = Path(__file__).resolve().parents[2]
MESSAGE = {"model": "claude-opus-5-5", "max_tokens": 64, "stream": True,
           "messages": [{"role": "user", "content": "hi"}]}
REPLY = "Hello from the scripted model."  # 30 characters, one token each


class StopRecordingEngine(ScriptedEngine):
    """Stops like the real Engine: whatever still runs is cancelled."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stopped_at: list[float] = []

    def stop(self, grace_s: float = 0.0) -> None:
        self.stopped_at.append(time.monotonic())
        self.cancelled.update(r.request_id for r in self.requests)
        super().stop(grace_s)


async def stream_events(url: str, started: asyncio.Event | None = None) -> list[str]:
    """The SSE event names of one streamed message; sets ``started`` at the first one."""
    names: list[str] = []
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{url}/v1/messages", json=MESSAGE) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    names.append(line.removeprefix("event: "))
                    if started is not None:
                        started.set()
    return names


def text_deltas(names: list[str]) -> int:
    return names.count("content_block_delta")


# -- EmbeddedServer ---------------------------------------------------------------------------


async def test_start_on_port_zero_reports_the_bound_port_and_stop_closes_it(tmp_path: Path) -> None:
    server = EmbeddedServer(create_app(make_service(tmp_path)), "127.0.0.1", 0, grace_s=1)
    port = await server.start()
    assert port > 0 and server.url == f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{server.url}/health/live")).json() == {"status": "ok"}
    began = time.monotonic()
    await server.stop()
    assert time.monotonic() - began < 1
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as client:
            await client.get(f"{server.url}/health/live")


async def test_start_fails_cleanly_when_the_port_is_taken(tmp_path: Path) -> None:
    first = EmbeddedServer(create_app(make_service(tmp_path)), "127.0.0.1", 0)
    port = await first.start()
    try:
        with pytest.raises(OSError):
            await EmbeddedServer(create_app(make_service(tmp_path)), "127.0.0.1", port).start()
    finally:
        await first.stop()


async def test_stop_lets_a_stream_within_the_grace_period_finish(tmp_path: Path) -> None:
    engine = ScriptedEngine(token_delay_s=0.03)  # about 1 s for the whole reply
    server = EmbeddedServer(create_app(make_service(tmp_path, engine)), "127.0.0.1", 0, grace_s=5)
    await server.start()
    started = asyncio.Event()
    stream = asyncio.create_task(stream_events(server.url, started))
    await started.wait()

    stopping = asyncio.create_task(server.stop())
    await asyncio.sleep(0.3)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        async with httpx.AsyncClient() as client:
            await client.get(f"{server.url}/health/live")
    names = await stream
    await stopping

    assert names[-1] == "message_stop" and text_deltas(names) == len(REPLY)
    assert not engine.cancelled


async def test_after_the_grace_period_the_hook_cancels_and_the_stream_ends_cleanly(tmp_path: Path) -> None:
    engine = StopRecordingEngine(token_delay_s=0.2)  # 6 s for the whole reply
    service = make_service(tmp_path, engine)

    async def stop_engine() -> None:
        await asyncio.to_thread(engine.stop, 0.0)

    server = EmbeddedServer(create_app(service), "127.0.0.1", 0, grace_s=0.5, on_grace_expired=stop_engine)
    await server.start()
    started = asyncio.Event()
    stream = asyncio.create_task(stream_events(server.url, started))
    await started.wait()

    began = time.monotonic()
    await server.stop()
    names = await stream

    assert len(engine.stopped_at) == 1 and 0.5 <= engine.stopped_at[0] - began < 1.5
    assert time.monotonic() - began < 0.5 + FLUSH_S
    assert names[-1] == "error" and 0 < text_deltas(names) < len(REPLY)


async def test_without_a_hook_uvicorn_cuts_streams_after_grace_and_flush(tmp_path: Path) -> None:
    engine = ScriptedEngine(token_delay_s=0.2)
    server = EmbeddedServer(create_app(make_service(tmp_path, engine)), "127.0.0.1", 0, grace_s=0.3)
    await server.start()
    started = asyncio.Event()
    stream = asyncio.create_task(stream_events(server.url, started))
    await started.wait()

    began = time.monotonic()
    await server.stop()
    assert time.monotonic() - began < 0.3 + FLUSH_S + 1.0
    with pytest.raises(httpx.RemoteProtocolError):  # the connection closed mid-stream
        await stream
    await asyncio.sleep(0.3)
    assert engine.cancelled == {engine.requests[0].request_id}  # the handler's cleanup cancelled the turn


# -- the headless run, in-process -------------------------------------------------------------


def headless_settings(tmp_path: Path, **values: Any) -> Settings:
    return Settings(cache_dir=tmp_path, port=0, ping_interval_s=0.05, **values)


async def wait_ready(run: HeadlessRun, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not run.service.is_ready:
        assert time.monotonic() < deadline, "the engine never became ready"
        await asyncio.sleep(0.01)


async def test_headless_drains_streams_then_stops_the_engine(tmp_path: Path) -> None:
    engine = StopRecordingEngine(token_delay_s=0.03)
    run = HeadlessRun(headless_settings(tmp_path, shutdown_grace_s=5), lambda settings, progress: engine)
    running = asyncio.create_task(run.run())
    await wait_ready(run)
    started = asyncio.Event()
    stream = asyncio.create_task(stream_events(run.server.url, started))
    await started.wait()

    run._on_signal(signal.SIGTERM)
    names = await stream
    finished_at = time.monotonic()
    assert await running == 0

    assert names[-1] == "message_stop" and text_deltas(names) == len(REPLY)
    assert len(engine.stopped_at) == 1 and engine.stopped_at[0] >= finished_at


async def test_headless_answers_not_ready_while_the_model_loads(tmp_path: Path) -> None:
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_factory(settings: Settings, progress: Any) -> ScriptedEngine:
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
        return StopRecordingEngine()

    run = HeadlessRun(headless_settings(tmp_path), slow_factory)
    running = asyncio.create_task(run.run())
    while run.server.port == 0:
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(base_url=run.server.url) as client:
        not_ready = await client.get("/health/ready")
        assert not_ready.status_code == 503 and not_ready.json()["detail"] == "loading the model"
        assert (await client.get("/health/live")).status_code == 200
        release.set()
        await wait_ready(run)
        assert (await client.get("/health/ready")).json()["model"] == "scripted"
    run._on_signal(signal.SIGINT)
    assert await running == 0


async def test_headless_exits_1_when_the_model_fails_to_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def failing(settings: Settings, progress: Any) -> ScriptedEngine:
        raise ModelLoadError("no such model: nope")

    assert await HeadlessRun(headless_settings(tmp_path), failing).run() == 1
    assert "model failed to load: no such model: nope" in caplog.text


# -- the headless run as a process ------------------------------------------------------------

CHILD = """
import sys, weakref
from engine.api.serve import serve_headless
from engine.logging_setup import configure_logging
from engine.settings import Settings
from tests.unit.test_serve import StopRecordingEngine

class Engine(StopRecordingEngine):
    def stop(self, grace_s=0.0):
        print("engine stopped", flush=True)
        super().stop(grace_s)

def factory(settings, progress):
    engine = Engine(token_delay_s=0.03)
    made.append(weakref.ref(engine))
    return engine

made = []
configure_logging("info", json_lines=True)
settings = Settings(cache_dir=sys.argv[1], port=0, shutdown_grace_s=5, ping_interval_s=0.05)
status = serve_headless(settings, factory)
# The real engine's model must be freed before interpreter teardown (see serve._free_mlx_arrays).
print("engine freed" if made and made[0]() is None else "engine still referenced", flush=True)
sys.exit(status)
"""


def listening_port(process: subprocess.Popen[str], timeout_s: float = 30) -> int:
    """The port from the JSON log line announcing the listener."""
    deadline = time.monotonic() + timeout_s
    assert process.stderr is not None
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        record = json.loads(line)
        if record.get("msg", "").startswith("listening on"):
            return int(record["port"])
    raise AssertionError("the server never logged its port")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_the_stream_stops_the_engine_and_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{listening_port(process)}"
        _wait_http_ready(url)
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/messages", json=MESSAGE) as response:
            lines = response.iter_lines()
            assert next(lines) == "event: message_start"
            process.send_signal(sig)
            names = ["message_start"] + [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
    assert names[-1] == "message_stop" and text_deltas(names) == len(REPLY)
    assert process.stdout is not None and process.stdout.read() == "engine stopped\nengine freed\n"


def _wait_http_ready(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/health/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("never ready")


def test_progress_logs_each_stage_once_when_it_starts_and_once_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    progress = ProgressLog()
    caplog.set_level("INFO", logger="semantic.serve")
    for update in [("hashing", 0, 300), ("hashing", 100, 300), ("hashing", 300, 300), ("tensors", 0, 2),
                   ("tensors", 2, 2), ("tensors", 2, 2), ("loading", 0, 1), ("loading", 1, 1)]:
        progress(ImportProgress(*update))
    messages = [record.getMessage().split(" in ")[0] for record in caplog.records]
    assert messages == ["model hashing: started", "model hashing: done", "model tensors: started",
                        "model tensors: done", "model loading: started", "model loading: done"]
