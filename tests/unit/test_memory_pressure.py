"""Memory watermarks: under pressure the engine sends idle caches away, admits as memory allows, then refuses.

The machine's memory is read through a fake here (a number the test moves),
so each path can be forced: soft (idle agents cooled or spilled, the pool not
grown past what it held, one turn always running), hard (new requests refused
with the protocol's overload error and retry-after, queued turns served),
recovery. The engine runs a tiny random-weight llama; its turns are compared
token for token with plain mlx-lm. A real-model test over HTTP drives the
watermarks through ``PUT /v1/admin/memory`` (tests/model/test_memory_pressure_real.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine.domain.event_log import EventLog
from engine.domain.requests import FinishEvent, GenerationRequest, TokenEvent
from engine.errors import MemoryPressureError
from engine.platform.memory import GIB, MemoryReading, default_watermarks
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.engine_seams import EngineSeams
from engine.runtime.engine_thread.sync_client import TurnResult, run_turn, run_turns
from engine.runtime.memory_pressure import MemoryWatch, Pressure, Watermarks
from engine.runtime.tiers.agents import Tier
from engine.settings import Settings
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.byte_tokenizer import BOS
from tests.support.engine_settings import engine_settings
from tests.support.family_engine import accounts_agree, check
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit

TOTAL = 16 * GIB
MARKS = Watermarks(soft=12 * GIB, hard=14 * GIB)


class FakeMemory:
    """A machine whose memory in use the test sets."""

    def __init__(self, used: int = 4 * GIB) -> None:
        self.used = used

    def __call__(self) -> MemoryReading:
        return MemoryReading(TOTAL, TOTAL - self.used, 1 * GIB, GIB // 2, 0)


# -- the watermarks and their levels -----------------------------------------------------------
def test_default_watermarks_leave_a_share_of_the_machine_free() -> None:
    assert default_watermarks(24 * GIB) == (24 * GIB - 24 * GIB * 15 // 100, 24 * GIB - 24 * GIB * 5 // 100)
    soft, hard = default_watermarks(8 * GIB)  # small machines keep at least 2 GiB and 1 GiB free
    assert (soft, hard) == (6 * GIB, 7 * GIB)
    assert Watermarks.for_machine(TOTAL, soft_mb=15 * 1024) == Watermarks(15 * GIB, 15 * GIB)  # hard follows
    assert Watermarks.for_machine(TOTAL, hard_mb=8 * 1024) == Watermarks(8 * GIB, 8 * GIB)  # soft follows
    with pytest.raises(ValueError, match="soft <= hard"):
        Watermarks(2 * GIB, GIB)
    with pytest.raises(ValueError, match="memory_soft_limit_mb .* must not exceed memory_hard_limit_mb"):
        Settings(memory_soft_limit_mb=2000, memory_hard_limit_mb=1000)


def test_levels_rise_at_each_watermark_and_fall_only_a_margin_below() -> None:
    memory = FakeMemory()
    watch = MemoryWatch(MARKS, memory)
    clock = iter(range(100))

    def at(used_gib: float) -> Pressure:
        memory.used = int(used_gib * GIB)
        watch.sample(float(next(clock)))
        return watch.pressure

    margin = max(TOTAL // 50, GIB // 4) / GIB
    assert at(4) is Pressure.NORMAL
    assert at(12) is Pressure.SOFT
    assert at(12 - margin / 2) is Pressure.SOFT  # inside the margin: stays
    assert at(14) is Pressure.HARD
    assert at(14 - margin / 2) is Pressure.HARD
    assert at(13) is Pressure.SOFT
    assert at(12 - margin - 0.01) is Pressure.NORMAL
    assert watch.describe()["pressure"] == "normal"
    # At most ten readings a second: a second sample within 0.1 s reads nothing.
    memory.used = 15 * GIB
    assert watch.sample(1000.0) is Pressure.HARD and watch.sample(1000.05) is None


# -- the engine under pressure ------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded():
    return loaded_tiny("llama", block_tokens=16)


@pytest.fixture
def pressured(loaded, tmp_path: Path) -> Iterator[tuple[Engine, FakeMemory]]:
    memory = FakeMemory()
    engine = Engine(loaded, engine_settings(64 * 2**20, 8, 32), store=WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()),
                    seams=EngineSeams(memory=MemoryWatch(MARKS, memory)))
    engine.start()
    try:
        yield engine, memory
    finally:
        engine.stop(0.0)


def _prompt(i: int, n: int = 6) -> tuple[int, ...]:
    return (BOS, *(f"agent {i} talks about memory. " * n).encode())


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _tiers(engine: Engine) -> dict[str, Tier]:
    return engine.call(lambda e: {a.agent_id: a.tier for a in e.agents}).result(30)


def test_soft_pressure_spills_idle_agents_and_their_next_turns_come_back_identical(loaded, pressured) -> None:
    engine, memory = pressured
    firsts = run_turns(engine, [GenerationRequest(f"a{i}", _prompt(i), 8) for i in range(3)])
    for result in firsts:
        check(loaded, result)
    assert set(_tiers(engine).values()) == {Tier.HOT}
    memory.used = 13 * GIB  # past soft, short of hard
    _until(lambda: set(_tiers(engine).values()) == {Tier.WARM})
    lines = [e.message for e in engine.events.since(0)]
    assert any("memory past the soft watermark" in line for line in lines), lines[-5:]
    assert any("hot -> warm" in line and "memory pressure" in line for line in lines), lines[-5:]
    assert engine.fresh_snapshot().memory["pressure"] == "soft"
    # Under pressure a turn still runs (one always does), from its cache read back from disk.
    follow = _prompt(0) + tuple(firsts[0].tokens) + tuple(b" and more?")
    again = run_turn(engine, GenerationRequest("a0", follow, 8))
    check(loaded, again)
    assert again.finish.usage.reused_tokens >= len(_prompt(0)) + len(firsts[0].tokens) - 1
    accounts_agree(engine)


def test_soft_pressure_admits_new_turns_only_as_idle_caches_make_room(loaded, pressured) -> None:
    """Under soft pressure the pool is not grown: two new agents' turns queued together run one after the
    other (the second admitted once the first is idle and can be sent away), both identical to mlx-lm."""
    engine, memory = pressured
    memory.used = 13 * GIB
    _until(lambda: engine.fresh_snapshot().memory["pressure"] == "soft")
    ceiling = engine.call(lambda e: e.scheduler.admission.ceiling).result(30)
    assert ceiling == 0  # nothing was held when pressure began
    timed: dict[str, list[tuple[float, object]]] = {"n0": [], "n1": []}
    requests = [GenerationRequest(f"n{i}", _prompt(10 + i), 8) for i in range(2)]
    for request in requests:
        engine.submit(request, lambda event, mine=timed[request.agent_id]: mine.append((time.monotonic(), event)))
    _until(lambda: all(events and isinstance(events[-1][1], FinishEvent) for events in timed.values()), 60)
    for request in requests:
        result = TurnResult(request)
        result.events.extend(event for _, event in timed[request.agent_id])
        check(loaded, result)
    # The second turn produced nothing before the first had finished.
    first_done = timed["n0"][-1][0]
    assert all(at >= first_done for at, event in timed["n1"] if isinstance(event, TokenEvent)), timed
    _until(lambda: _tiers(engine)["n0"] in (Tier.WARM, Tier.COLD))  # idle, sent away under the pressure
    accounts_agree(engine)


def test_hard_pressure_refuses_new_requests_and_recovery_admits_them(loaded, pressured) -> None:
    engine, memory = pressured
    check(loaded, run_turn(engine, GenerationRequest("h", _prompt(1), 8)))
    memory.used = 15 * GIB
    _until(lambda: engine.fresh_snapshot().memory["pressure"] == "hard")
    with pytest.raises(MemoryPressureError, match="past the hard watermark") as refused:
        run_turn(engine, GenerationRequest("h", _prompt(1) + tuple(b" next"), 8))
    assert refused.value.retry_after_s > 0
    memory.used = 4 * GIB
    _until(lambda: engine.fresh_snapshot().memory["pressure"] == "normal")
    assert engine.call(lambda e: e.scheduler.admission.ceiling).result(30) is None
    check(loaded, run_turn(engine, GenerationRequest("h", _prompt(1) + tuple(b" next"), 8)))
    lines = [e.message for e in engine.events.since(0)]
    assert any("memory back to normal" in line for line in lines), lines[-5:]


def test_watermarks_change_while_running(pressured) -> None:
    engine, memory = pressured
    engine.set_memory_watermarks(Watermarks(2 * GIB, 3 * GIB))  # below the 4 GiB in use
    _until(lambda: engine.fresh_snapshot().memory["pressure"] == "hard")
    engine.set_memory_watermarks(MARKS)
    _until(lambda: engine.fresh_snapshot().memory["pressure"] == "normal")


# -- over HTTP: the protocols' overload errors --------------------------------------------------
def test_hard_pressure_is_anthropic_529_and_openai_503_with_retry_after(loaded, tmp_path: Path) -> None:
    from engine.api.app import create_app
    from tests.support.router_app import LiveServer, make_service

    memory = FakeMemory()
    engine = Engine(loaded, engine_settings(64 * 2**20, 8, 32), seams=EngineSeams(memory=MemoryWatch(MARKS, memory)))
    engine.start()
    try:
        with LiveServer(create_app(make_service(tmp_path, engine))) as server:  # type: ignore[arg-type]
            stats = httpx.get(f"{server.url}/v1/stats", timeout=30).json()
            assert stats["memory"]["pressure"] == "normal" and stats["memory"]["soft_watermark_bytes"] == MARKS.soft
            response = httpx.put(f"{server.url}/v1/admin/memory", json={"soft_limit_mb": 1024, "hard_limit_mb": 2048},
                                 timeout=30)
            assert response.status_code == 200 and response.json()["pressure"] == "hard", response.text
            anthropic = httpx.post(f"{server.url}/v1/messages", timeout=30, json={
                "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert anthropic.status_code == 529, anthropic.text
            assert anthropic.json()["error"]["type"] == "overloaded_error"
            assert int(anthropic.headers["retry-after"]) > 0
            openai = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
                "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert openai.status_code == 503 and int(openai.headers["retry-after"]) > 0, openai.text
            assert "hard watermark" in openai.json()["error"]["message"]
            metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
            assert "semantic_memory_pressure 2.0" in metrics and 'semantic_memory_bytes{kind="soft_watermark"}' in metrics
            bad = httpx.put(f"{server.url}/v1/admin/memory", json={"soft_limit_mb": 4096}, timeout=30)
            assert bad.status_code == 400 and "exceed the hard one" in bad.text, bad.text
            back = httpx.put(f"{server.url}/v1/admin/memory", json={"soft_limit_mb": 12 * 1024,
                                                                     "hard_limit_mb": 14 * 1024}, timeout=30)
            assert back.json()["pressure"] == "normal", back.text
            ok = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
                "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert ok.status_code == 200, ok.text
    finally:
        engine.stop(0.0)
