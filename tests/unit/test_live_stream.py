"""GET /v1/stream against a ScriptedEngine: frames, resume, the bounds a slow client meets, cleanup, the
client cap and the API key.

The stream never ends, so these tests read it from a real uvicorn (LiveServer):
an in-process ASGI client would wait for the end of the body before handing
any of it over.
"""

from __future__ import annotations

import asyncio
import re
import socket
import statistics
import time
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import pytest

from engine.api.live_stream import Drops, LogFrame, StreamHub, StreamOptions, Subscriber, next_tick
from engine.api.serve import EmbeddedServer
from engine.api.service import EngineService
from engine.domain.event_log import EventKind
from tests.support.live_stream_client import Frame, frames, next_frame
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.unit

TIMEOUT = httpx.Timeout(10)


@pytest.fixture
def service(tmp_path: Path) -> EngineService:
    return make_service(tmp_path, ScriptedEngine(), stream_max_clients=3)


@pytest.fixture
def server(service: EngineService) -> Iterator[LiveServer]:
    with LiveServer(build_app(service)) as running:
        yield running


def hub_of(server: LiveServer) -> StreamHub:
    return server._server.config.app.state.stream_hub  # type: ignore[attr-defined]


async def wait_until(check, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Stream:
    """One open stream: its frames as an iterator."""

    def __init__(self, client: httpx.AsyncClient, query: str = "", headers: dict[str, str] | None = None) -> None:
        self._context = client.stream("GET", f"/v1/stream{query}", headers=headers or {})
        self.response: httpx.Response | None = None
        self.frames: AsyncIterator[Frame] | None = None

    async def __aenter__(self) -> "Stream":
        self.response = await self._context.__aenter__()
        assert self.response.status_code == 200, await self.response.aread()
        assert self.response.headers["content-type"].startswith("text/event-stream")
        self.frames = frames(self.response)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._context.__aexit__(*exc)

    async def next(self, *events: str) -> Frame:
        assert self.frames is not None
        async with asyncio.timeout(10):
            return await next_frame(self.frames, *events)


def client(server: LiveServer, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, headers=headers)


# -- frames -----------------------------------------------------------------------------------------


async def test_hello_then_stats_frames_at_the_interval_with_the_stats_body(server: LiveServer) -> None:
    async with client(server) as http, Stream(http, "?interval=0.2") as stream:
        first = await stream.next("hello", "stats", "log")
        stats = [await stream.next("stats") for _ in range(5)]
        polled = (await http.get("/v1/stats?blocks=true")).json()
    assert first.event == "hello"
    hello = first.data
    assert hello["server"] == "semantic" and hello["model"] == "scripted"
    assert (hello["interval_s"], hello["blocks"], hello["after"], hello["max_clients"]) == (0.2, True, None, 3)
    # The very body of GET /v1/stats?blocks=true: the block map, and the served models' list.
    assert set(stats[-1].data) == set(polled)
    assert stats[-1].data["model"] == polled["model"]
    assert len(stats[-1].data["pool"]["block_map"]["owners"]) == polled["pool"]["total_blocks"]
    gaps = [b.at - a.at for a, b in zip(stats[1:], stats[2:])]
    assert 0.12 <= statistics.median(gaps) <= 0.4, gaps


async def test_blocks_false_leaves_out_the_block_map(server: LiveServer) -> None:
    async with client(server) as http, Stream(http, "?interval=0.1&blocks=false") as stream:
        stats = await stream.next("stats")
    assert stats.data["pool"]["block_map"] is None


async def test_log_events_arrive_in_order_with_their_seq_and_a_turn_shows_in_the_next_stats(
    server: LiveServer, service: EngineService
) -> None:
    async with client(server) as http, Stream(http, "?interval=0.1") as stream:
        hello = await stream.next("hello")
        for i in range(5):
            service.events.emit(EventKind.INFO, f"note {i}", agent_id=f"agent-{i}")
        logs = [await stream.next("log") for _ in range(5)]
        body = {"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
        turn = await http.post("/v1/messages", json=body, headers={"x-claude-code-session-id": "live-1"})
        assert turn.status_code == 200, turn.text
        finish = await stream.next("log")
        while not any(a["agent_id"] == finish.data["agent_id"] for a in (await stream.next("stats")).data["agents"]):
            pass
    start = hello.data["log_seq"]
    assert [f.data["seq"] for f in logs] == list(range(start + 1, start + 6))
    assert [f.id for f in logs] == [str(start + i) for i in range(1, 6)]
    assert [(f.data["kind"], f.data["message"], f.data["agent_id"], f.data["level"]) for f in logs] == [
        ("info", f"note {i}", f"agent-{i}", 20) for i in range(5)]
    assert finish.data["kind"] == "finish" and finish.data["seq"] == start + 6


async def test_a_client_resumes_after_a_seq_by_query_or_last_event_id(
    server: LiveServer, service: EngineService
) -> None:
    for i in range(6):
        service.events.emit(EventKind.INFO, f"before {i}")
    async with client(server) as http:
        async with Stream(http, "?after=2") as stream:
            resumed = [await stream.next("log") for _ in range(4)]
            service.events.emit(EventKind.INFO, "live")
            live = await stream.next("log")
        # An EventSource reconnecting sends the last id it saw: it wins over the URL's after.
        async with Stream(http, "?after=0", {"Last-Event-ID": "5"}) as stream:
            again = [await stream.next("log") for _ in range(2)]
    assert [f.data["message"] for f in resumed] == ["before 2", "before 3", "before 4", "before 5"]
    assert live.data["message"] == "live" and live.data["seq"] == 7
    assert [f.data["seq"] for f in again] == [6, 7]


async def test_a_resume_past_what_the_ring_holds_is_told_as_dropped(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    engine.events = type(engine.events)(capacity=4)
    service = make_service(tmp_path, engine)
    for i in range(10):
        service.events.emit(EventKind.INFO, f"e{i + 1}")
    with LiveServer(build_app(service)) as server:
        async with client(server) as http, Stream(http, "?after=2") as stream:
            dropped = await stream.next("dropped")
            kept = [await stream.next("log") for _ in range(4)]
    assert dropped.data == {"stats": 0, "log": 4, "log_missed": {"first": 3, "last": 6}}
    assert [f.data["seq"] for f in kept] == [7, 8, 9, 10]


# -- bounds -----------------------------------------------------------------------------------------


def test_a_subscriber_keeps_one_stats_frame_and_a_bounded_log_and_counts_the_rest() -> None:
    async def run() -> None:
        subscriber = Subscriber(StreamOptions(0.5, True), log_bound=3, due_at=0.0)
        for i in range(10):
            subscriber.offer_stats(f"stats {i}".encode())
        for seq in range(1, 8):
            subscriber.offer_log(LogFrame(seq, f"log {seq}|".encode()))
        assert subscriber.pending_bytes == len(b"stats 9") + 3 * len(b"log 7|")
        chunk = subscriber.take().decode()
        assert chunk.startswith('event: dropped\ndata: {"stats":9,"log":4,"log_missed":{"first":1,"last":4}}\n\n')
        assert chunk.endswith("log 5|log 6|log 7|stats 9")
        assert subscriber.take() == b"" and subscriber.drops == Drops()

    asyncio.run(run())


def test_clients_of_one_interval_fall_due_together() -> None:
    assert next_tick(10.01, 0.5) == next_tick(10.49, 0.5) == 10.5
    assert next_tick(10.5, 0.5) == 11.0


async def test_a_client_that_stops_reading_drops_frames_holds_little_and_is_told(service: EngineService) -> None:
    with LiveServer(build_app(service), send_buffer=8192) as server:
        await stop_reading_and_resume(server, service)


async def stop_reading_and_resume(server: LiveServer, service: EngineService) -> None:
    hub = hub_of(server)
    hub.log_bound = 8
    reader, writer = await slow_connection(server.port, "/v1/stream?interval=0.1")
    try:
        await reader.readexactly(64)  # the response head: then it reads nothing for a while
        await wait_until(lambda: hub.subscribers == 1, "the slow client")
        slow = hub.clients[0]
        message = "x" * 2000
        deadline = time.monotonic() + 20
        while hub.totals.stats_dropped < 3 or slow.drops.log < 20:
            assert time.monotonic() < deadline, (hub.totals, slow.pending_bytes)
            for _ in range(50):
                service.events.emit(EventKind.INFO, message)
            # Never more than one stats frame and log_bound log frames waiting, however far behind it is.
            assert slow.pending_bytes <= 8 * 2300 + 20_000, slow.pending_bytes
            await asyncio.sleep(0.1)
        raw = await read_for(reader, 1.0)
    finally:
        writer.close()
    told = [re.search(rb'"stats":(\d+),"log":(\d+)', m.group(0)) for m in
            re.finditer(rb"event: dropped\ndata: [^\n]*", raw)]
    assert told, raw[-500:]
    assert sum(int(t.group(1)) for t in told) > 0 and sum(int(t.group(2)) for t in told) > 0
    metrics = (await httpx.AsyncClient(base_url=server.url).get("/metrics")).text
    assert re.search(r'semantic_stream_dropped_frames_total\{kind="stats"\} [1-9]', metrics), metrics
    await wait_until(lambda: hub.subscribers == 0, "the slow client's cleanup")


async def slow_connection(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client with a tiny receive window, so that not reading soon fills what the kernel would buffer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    # A small limit: the reader stops taking bytes from the socket once it holds twice that, unread.
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def read_for(reader: asyncio.StreamReader, seconds: float) -> bytes:
    data = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            async with asyncio.timeout(left):
                data += await reader.read(2**16)
        except TimeoutError:
            break
    return data


# -- lifecycle ----------------------------------------------------------------------------------------


async def test_clients_that_leave_are_forgotten_at_once_and_the_publisher_stops(server: LiveServer) -> None:
    hub = hub_of(server)
    async with client(server) as http:
        async with Stream(http) as a, Stream(http) as b:
            await a.next("stats")
            await b.next("stats")
            assert (hub.subscribers, hub.publishing) == (2, True)
        await wait_until(lambda: hub.subscribers == 0, "both clients forgotten")
        assert not hub.publishing
        async with Stream(http) as c:  # and it starts again for the next one
            await c.next("stats")
            assert (hub.subscribers, hub.publishing) == (1, True)
    await wait_until(lambda: hub.subscribers == 0 and not hub.publishing, "the last client forgotten")


async def test_past_the_client_cap_a_new_stream_is_a_429(server: LiveServer) -> None:
    async with client(server) as http:
        async with Stream(http) as a, Stream(http), Stream(http):
            refused = await http.get("/v1/stream")
            await a.next("stats")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
        body = refused.json()
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert "stream_max_clients 3" in body["error"]["message"]
        await wait_until(lambda: hub_of(server).subscribers == 0, "the three forgotten")
        async with Stream(http) as again:
            assert (await again.next("hello")).event == "hello"
        metrics = (await http.get("/metrics")).text
    assert "semantic_stream_refused_total 1.0" in metrics


async def test_shutdown_ends_open_streams_instead_of_waiting_out_the_grace(service: EngineService) -> None:
    server = EmbeddedServer(build_app(service), "127.0.0.1", 0, grace_s=10.0)
    port = await server.start()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as http:
        async with Stream(http) as stream:
            await stream.next("stats")
            began = time.monotonic()
            await server.stop()
            assert time.monotonic() - began < 3
            async with asyncio.timeout(5):
                async for _ in stream.frames:  # type: ignore[union-attr]
                    pass


# -- parameters and auth ------------------------------------------------------------------------------


@pytest.mark.parametrize("query, field", [("?interval=0.05", "interval"), ("?interval=11", "interval"),
                                          ("?after=-1", "after")])
async def test_out_of_range_parameters_are_a_400_naming_the_field(
    server: LiveServer, query: str, field: str
) -> None:
    async with client(server) as http:
        response = await http.get(f"/v1/stream{query}")
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert f"query.{field}" in body["error"]["message"]


async def test_a_last_event_id_that_is_no_seq_is_a_400(server: LiveServer) -> None:
    async with client(server) as http:
        response = await http.get("/v1/stream", headers={"Last-Event-ID": "abc"})
    assert response.status_code == 400 and "Last-Event-ID" in response.json()["error"]["message"]


async def test_with_an_api_key_the_stream_needs_it(tmp_path: Path) -> None:
    service = make_service(tmp_path, ScriptedEngine(), api_key="s3cret")
    with LiveServer(build_app(service)) as server:
        async with client(server) as http:
            refused = await http.get("/v1/stream")
        assert refused.status_code == 401
        assert refused.json() == {"type": "error", "error": {
            "type": "authentication_error",
            "message": "invalid or missing API key (send x-api-key or Authorization: Bearer)"}}
        assert hub_of(server).subscribers == 0
        async with client(server, **{"x-api-key": "s3cret"}) as http, Stream(http) as stream:
            assert (await stream.next("hello")).data["server"] == "semantic"
        async with client(server, authorization="Bearer s3cret") as http, Stream(http) as stream:
            assert (await stream.next("stats")).data["status"] == "ready"
