"""Failures that must stay contained (issue 13): one turn's trouble never stops the others.

Each test injects the fault the review found and checks the fix: a failing
admission fails that turn alone, a failing event sink detaches, a turn
queued during shutdown is answered, a warm read is not repeated, and the
pool-exhaustion paths (mid-decode, a restore bigger than the pool, one new
agent asked for twice at once) end cleanly.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from engine.errors import EngineUnavailableError
from engine.runtime.tiers.accounting import held_bytes
from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.domain.event_log import EventLog
from engine.domain.requests import FinishEvent, FinishReason, GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.byte_tokenizer import EOS
from tests.support.reference import reference_greedy
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_engine_batching import make_engine, prompt_for, without_eos

pytestmark = pytest.mark.unit


def accounts(engine: Engine) -> tuple[int, int]:
    return engine.call(lambda e: (held_bytes(e.agents), e.pool.used_bytes)).result()


def test_a_failing_admission_fails_that_turn_alone() -> None:
    engine = make_engine("llama")
    try:
        admit = engine.call(lambda e: e.scheduler.admission.caches.prepare).result()

        def flaky(turn, running):
            if turn.request.agent_id == "bad":
                raise RuntimeError("injected admission failure")
            return admit(turn, running)

        engine.call(lambda e: setattr(e.scheduler.admission.caches, "prepare", flaky)).result()
        requests = [GenerationRequest(f"ok-{i}", prompt_for(i), 8) for i in range(3)]
        results = run_turns(engine, requests[:2] + [GenerationRequest("bad", prompt_for(5), 8)] + requests[2:])
        bad = results[2]
        assert bad.finish.reason is FinishReason.ERROR and "injected admission failure" in bad.finish.error
        for result in results[:2] + results[3:]:
            expected = reference_greedy(engine.loaded.model, list(result.request.prompt_tokens), 8, {EOS})
            assert result.tokens == without_eos(expected)
        # The engine goes on admitting: the next turn is served.
        assert run_turn(engine, GenerationRequest("after", prompt_for(1), 4)).finish.error is None
        held, counted = accounts(engine)
        assert held == counted
    finally:
        engine.stop()


def test_a_failing_sink_detaches_and_nothing_else_notices() -> None:
    engine = make_engine("llama")
    try:
        seen: list[str] = []
        done = threading.Event()

        def broken(event) -> None:
            raise RuntimeError("the client's event loop is closed")

        def sink(event) -> None:
            seen.append(type(event).__name__)
            if isinstance(event, FinishEvent):
                done.set()

        engine.submit(GenerationRequest("gone", prompt_for(0, 4), 64), broken)
        engine.submit(GenerationRequest("here", prompt_for(1), 16), sink)
        assert done.wait(60)
        assert seen[-1] == "FinishEvent" and seen.count("TokenEvent") >= 1
        snap = engine.fresh_snapshot()
        assert snap.agent("gone").state == "idle"  # its turn was cancelled, its cache settled
        held, counted = accounts(engine)
        assert held == counted
    finally:
        engine.stop()


def test_a_failing_watcher_is_detached() -> None:
    engine = make_engine("llama")
    try:
        def broken(event) -> None:
            raise RuntimeError("watcher gone")

        engine.watch("w", broken)
        result = run_turn(engine, GenerationRequest("w", prompt_for(0), 8))
        assert result.finish.error is None
        assert engine.call(lambda e: e.scheduler.delivery.watchers.get("w")).result() == []
    finally:
        engine.stop()


def test_a_turn_queued_while_the_engine_stops_is_answered() -> None:
    engine = make_engine("llama")
    finished: list[FinishEvent] = []
    got = threading.Event()

    def sink(event) -> None:
        if isinstance(event, FinishEvent):
            finished.append(event)
            got.set()

    # Hold the engine thread so the turn is still queued when stop() closes the door.
    gate = threading.Event()
    engine.call(lambda e: gate.wait(10))
    engine.submit(GenerationRequest("late", prompt_for(0), 8), sink)
    stopper = threading.Thread(target=engine.stop, args=(0.0,))
    stopper.start()
    gate.set()
    stopper.join(30)
    assert got.wait(5), "a turn queued before the stop was never answered"
    assert finished[0].reason in (FinishReason.CANCELLED, FinishReason.LENGTH, FinishReason.STOP)
    with pytest.raises(EngineUnavailableError):
        engine.submit(GenerationRequest("later", prompt_for(0), 8), sink)


def test_the_pool_running_out_mid_decode_ends_the_turn_with_capacity() -> None:
    loaded = loaded_tiny("llama")
    config = engine_settings(4 * loaded.spec.block_bytes, 4, 32, repetition_window=0)
    engine = Engine(loaded, config)
    engine.start()
    try:
        prompt = prompt_for(0, 1)  # 21 tokens: 2 of the 4 blocks of 16
        result = run_turn(engine, GenerationRequest("greedy", prompt, 500))
        assert result.finish.reason is FinishReason.CAPACITY
        assert len(prompt) + result.finish.usage.generated_tokens <= 4 * 16
        held, counted = accounts(engine)
        assert held == counted == 4 * loaded.spec.block_bytes
        follow = run_turn(engine, GenerationRequest("other", prompt_for(1), 4))
        assert follow.finish.error is None  # the idle agent is evicted for it
    finally:
        engine.stop()


def test_a_restore_bigger_than_the_whole_pool_drops_to_cold_and_prefills(tmp_path: Path) -> None:
    loaded = loaded_tiny("llama")
    big = Engine(loaded, engine_settings(64 << 20, 4, 32), store=WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    big.start()
    long_prompt = prompt_for(0, 8)
    try:
        run_turn(big, GenerationRequest("long", long_prompt, 8))
    finally:
        big.stop()  # persisted on exit
    small = Engine(loaded, engine_settings(6 * loaded.spec.block_bytes, 4, 32),
                   store=WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    small.start()
    try:
        assert small.fresh_snapshot().agent("long").tier == "warm"
        short = prompt_for(0, 1)
        result = run_turn(small, GenerationRequest("long", short, 4))
        assert result.finish.error is None and result.finish.usage.reused_tokens == 0
        assert result.tokens == without_eos(reference_greedy(loaded.model, list(short), 4, {EOS}))
    finally:
        small.stop()


def test_a_warm_read_that_finds_no_room_is_kept_not_read_again(tmp_path: Path) -> None:
    loaded = loaded_tiny("llama")
    store = WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog())
    engine = Engine(loaded, engine_settings(10 * loaded.spec.block_bytes, 4, 32), store=store)
    engine.start()
    try:
        first = run_turn(engine, GenerationRequest("reader", prompt_for(0, 2), 4))
        engine.call(lambda e: e.ops.evict_agent("reader", Tier.WARM)).result()
        engine.call(lambda e: e._store.flush()).result()
        hog = run_turn(engine, GenerationRequest("hog", prompt_for(1, 6), 60))  # most of the pool
        assert hog.finish.error is None
        engine.call(lambda e: e.ops.pin_agent("hog", True)).result()
        follow = first.request.prompt_tokens + tuple(first.tokens) + tuple(b" more")
        refused = run_turn(engine, GenerationRequest("reader", follow, 4))
        assert refused.finish.error_type == "rate_limit"  # read from disk, but no room to put it
        reads = engine.call(lambda e: e._store.stats.reads).result()
        assert reads == 1
        engine.call(lambda e: e.ops.pin_agent("hog", False)).result()
        result = run_turn(engine, GenerationRequest("reader", follow, 4))
        assert result.finish.usage.reused_tokens > len(first.request.prompt_tokens)
        assert engine.call(lambda e: e._store.stats.reads).result() == reads  # the kept data, not a re-read
        assert engine.call(lambda e: "reader" in e._store._ready).result() is False  # installed: let go
    finally:
        engine.stop()


def test_one_new_agent_asked_for_twice_at_once_runs_its_turns_one_after_the_other() -> None:
    engine = make_engine("gemma")
    try:
        prompt = prompt_for(2, 2)
        first, second = run_turns(engine, [GenerationRequest("twin", prompt, 6), GenerationRequest("twin", prompt, 6)])
        assert first.finish.error is None and second.finish.error is None
        assert first.tokens == second.tokens == without_eos(reference_greedy(engine.loaded.model, list(prompt), 6, {EOS}))
        assert second.finish.usage.reused_tokens == len(prompt) - 1  # the second saw the first's cache
        snap = engine.fresh_snapshot()
        assert [a.agent_id for a in snap.agents].count("twin") == 1 and snap.agent("twin").turns == 2
    finally:
        engine.stop()
