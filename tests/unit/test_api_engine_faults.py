"""The HTTP API over a real Engine on a tiny random-weight model, served by
uvicorn: what clients see when the engine thread's batch step raises, and
how two requests for one agent are ordered.

A generator that raises mid-batch must end every stream in flight with its
protocol's error event (Anthropic ``event: error``, OpenAI an ``error`` data
frame then ``[DONE]``), leak no KV block, and leave the engine serving the
next request. Two streams on one agent both complete, the second admitted
only after the first finished (the engine runs one turn per agent at a time).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from engine.api.app import create_app
from engine.runtime.tiers.agents import Tier
from engine.runtime.scheduler.scheduler import sequence_batch_factory
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.engine_seams import EngineSeams
from tests.support.engine_settings import engine_settings
from engine.domain.requests import FinishEvent, FinishReason, PrefillEvent, QueuedEvent, TokenEvent
from tests.support.router_app import LiveServer, make_service
from tests.support.tiny_models import loaded_tiny

STEP_S = 0.01  # per decode step: streams long enough to overlap, a test short enough for CI
FAILURE = "simulated MLX failure mid-batch"
SESSION = "5f0c9a4e-0000-4000-8000-00000000000a"
Request = tuple[str, dict[str, Any], dict[str, str]]  # path, JSON body, headers


@dataclass
class FailureSwitch:
    """Shared by every batch the engine builds: the first ``step`` after arming raises, once."""

    armed: threading.Event = field(default_factory=threading.Event)
    fired: threading.Event = field(default_factory=threading.Event)


class SlowFlakyGenerator:
    """The engine's SequenceBatch, slowed down, raising once when the switch is armed."""

    def __init__(self, inner: Any, switch: FailureSwitch) -> None:
        self._inner = inner
        self._switch = switch

    def step(self, plan: Any, room: Any) -> Any:
        if self._switch.armed.is_set() and not self._switch.fired.is_set():
            self._switch.fired.set()
            raise RuntimeError(FAILURE)
        time.sleep(STEP_S)
        return self._inner.step(plan, room)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass
class Served:
    engine: Engine
    url: str
    switch: FailureSwitch
    # (engine-thread time, agent id, event) for every event of every turn, in the engine's order.
    timeline: list[tuple[float, str, Any]]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    switch = FailureSwitch()
    loaded = loaded_tiny("llama")

    def flaky_factory(loaded: Any, limits: Any, hooks: Any) -> SlowFlakyGenerator:
        return SlowFlakyGenerator(sequence_batch_factory(loaded, limits, hooks), switch)

    config = engine_settings(256 * loaded.spec.block_bytes, 4, 32)
    engine = Engine(loaded, config, seams=EngineSeams(batch_factory=flaky_factory))
    engine.start()
    timeline: list[tuple[float, str, Any]] = []
    submit = engine.submit

    def recording_submit(request: Any, sink: Any) -> str:
        def record(event: Any) -> None:
            timeline.append((time.monotonic(), request.agent_id, event))
            sink(event)

        return submit(request, record)

    engine.submit = recording_submit  # type: ignore[method-assign]
    try:
        with LiveServer(create_app(make_service(tmp_path, engine))) as server:  # type: ignore[arg-type]
            yield Served(engine, server.url, switch, timeline)
    finally:
        engine.stop(0.0)


def anthropic_request(content: str, max_tokens: int = 400) -> Request:
    # Greedy: these tests count tokens to a length finish; a sampled tiny model may stop early.
    body = {"model": "claude-opus-5-5", "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    return "/v1/messages", body, {"x-claude-code-session-id": SESSION}


def openai_request(content: str, max_tokens: int = 400) -> Request:
    body = {"model": "gpt-4o", "max_tokens": max_tokens, "stream": True, "session_id": "sess-b", "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    return "/v1/chat/completions", body, {}


def is_text(frame: str) -> bool:
    """An Anthropic text delta, or an OpenAI chunk with content (not the opening empty role delta)."""
    return frame.startswith("event: content_block_delta") or ('"content":"' in frame and '"content":""' not in frame)


async def stream(client: httpx.AsyncClient, request: Request, first_text: asyncio.Event | None = None) -> list[str]:
    """Every SSE frame of one streamed request; sets ``first_text`` at the first generated text."""
    path, body, headers = request
    frames: list[str] = []
    async with client.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        pending = ""
        async for chunk in response.aiter_text():
            pending += chunk
            while "\n\n" in pending:
                frame, pending = pending.split("\n\n", 1)
                frames.append(frame)
                if first_text is not None and is_text(frame):
                    first_text.set()
    return frames


def anthropic_events(frames: list[str]) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for frame in frames:
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def openai_data(frames: list[str]) -> list[Any]:
    out = []
    for frame in frames:
        if frame.startswith(":"):
            continue  # keep-alive comment
        data = frame.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_no_leak(engine: Engine) -> None:
    snapshot = engine.fresh_snapshot()
    idle = {a.agent_id for a in snapshot.agents if a.state == "idle"}
    assert set(snapshot.pool.owner_blocks) <= idle == {a.agent_id for a in snapshot.agents}
    engine.call(lambda e: e.ops.evict_idle(Tier.COLD)).result(10)
    assert engine.fresh_snapshot().pool.used_blocks == 0


async def test_a_batch_step_failure_ends_streams_in_flight_and_the_next_request_is_served(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        started = [asyncio.Event(), asyncio.Event()]
        story, counting = anthropic_request("Tell me a long story about the sea."), openai_request("Count slowly.")
        anthropic = asyncio.create_task(stream(client, story, started[0]))
        openai = asyncio.create_task(stream(client, counting, started[1]))
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
        served.switch.armed.set()  # both are decoding in one batch now
        anthropic_frames, openai_frames = await asyncio.wait_for(asyncio.gather(anthropic, openai), 30)
        assert served.switch.fired.is_set()

        events = anthropic_events(anthropic_frames)
        kinds = [name for name, _ in events]
        assert kinds[0] == "message_start" and "content_block_delta" in kinds and "message_stop" not in kinds
        name, error = events[-1]
        assert name == "error" and error["type"] == "error" and error["error"]["type"] == "api_error"
        assert error["error"]["message"] == f"generation failed: RuntimeError: {FAILURE}"

        data = openai_data(openai_frames)
        assert data[-1] == "[DONE]"
        assert data[-2] == {"error": {"message": f"generation failed: RuntimeError: {FAILURE}",
                                      "type": "server_error", "param": None, "code": None}}
        assert any(chunk["choices"][0]["delta"].get("content") for chunk in data[:-2])
        assert all(chunk["choices"][0]["finish_reason"] is None for chunk in data[:-2])

        # No block leaked: whatever is still held (prompt blocks kept for sharing) belongs to an
        # idle agent, and evicting every idle agent empties the pool.
        assert served.engine.is_running
        assert_no_leak(served.engine)

        # A fresh generator serves what comes next, the failed agents included.
        after = openai_data(await stream(client, openai_request("Count slowly.", max_tokens=12)))
        assert after[-1] == "[DONE]" and after[-2]["choices"][0]["finish_reason"] == "length"
        again = anthropic_events(await stream(client, anthropic_request("And now?", max_tokens=40)))
        assert [name for name, _ in again][-2:] == ["message_delta", "message_stop"]

    assert served.engine.fresh_snapshot().pool.used_blocks > 0
    assert_no_leak(served.engine)


@pytest.mark.parametrize("protocol", ["anthropic", "openai"])
async def test_two_streams_on_one_agent_run_one_after_the_other(served: Served, protocol: str) -> None:
    make = anthropic_request if protocol == "anthropic" else openai_request
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        first = asyncio.create_task(stream(client, make("first question", max_tokens=40)))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(stream(client, make("second question", max_tokens=40)))
        results = await asyncio.wait_for(asyncio.gather(first, second), 60)

    for frames in results:
        if protocol == "anthropic":
            assert [name for name, _ in anthropic_events(frames)][-2:] == ["message_delta", "message_stop"]
        else:
            data = openai_data(frames)
            assert data[-1] == "[DONE]" and data[-2]["choices"][0]["finish_reason"] == "length"

    agents = {agent_id for _, agent_id, _ in served.timeline}
    assert len(agents) == 1, agents  # one agent, so one turn at a time
    by_request: dict[str, list[tuple[float, Any]]] = {}
    for at, _, event in served.timeline:
        by_request.setdefault(event.request_id, []).append((at, event))
    (one, two) = sorted(by_request.values(), key=lambda events: events[0][0])
    one_finish = next(at for at, e in one if isinstance(e, FinishEvent))
    two_queued = next(at for at, e in two if isinstance(e, QueuedEvent))
    two_admitted = next(at for at, e in two if isinstance(e, PrefillEvent))
    two_first_token = next(at for at, e in two if isinstance(e, TokenEvent))
    assert two_queued < one_finish, "the second request must arrive while the first runs"
    assert one_finish < two_admitted < two_first_token
    assert all(e.reason is FinishReason.LENGTH for _, e in one + two if isinstance(e, FinishEvent))
    # Never interleaved: every event of the first turn's run comes before any of the second's.
    progress = (PrefillEvent, TokenEvent, FinishEvent)
    running = [e.request_id for _, _, e in served.timeline if isinstance(e, progress)]
    assert running == sorted(running, key=lambda rid: rid != one[0][1].request_id)
