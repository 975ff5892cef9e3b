"""Engine behaviour around the batch: cancellation, stops, budget, failures, stats."""

from __future__ import annotations

import gc
import queue
import threading
import time

import pytest

from engine.errors import EngineUnavailableError, PromptTooLongError, RequestTooLargeForPoolError
from engine.runtime.tiers.agents import Tier
from engine.runtime.scheduler.scheduler import sequence_batch_factory
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.engine_seams import EngineSeams
from engine.domain.requests import FinishEvent, FinishReason, GenerationRequest, TokenEvent
from tests.support.byte_tokenizer import BOS, EOS
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from tests.support.reference import reference_greedy
from tests.support.engine_settings import engine_settings
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_engine_batching import make_engine, prompt_for, without_eos


@pytest.fixture
def llama():
    eng = make_engine("llama")
    yield eng
    eng.stop()


def test_cancel_mid_decode_finishes_cancelled_and_keeps_cache(llama: Engine) -> None:
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    request = GenerationRequest("c", prompt_for(0), 400)
    llama.submit(request, inbox.put)
    tokens = 0
    while tokens < 5:
        event = inbox.get(timeout=30)
        tokens += isinstance(event, TokenEvent)
    llama.cancel(request.request_id)
    while not isinstance(event := inbox.get(timeout=30), FinishEvent):
        pass
    assert event.reason is FinishReason.CANCELLED
    assert 5 <= event.usage.generated_tokens < 400
    agent = llama.fresh_snapshot().agent("c")
    assert agent is not None and agent.tier == "hot"
    assert agent.cached_tokens == len(request.prompt_tokens) + event.usage.generated_tokens


def test_cancel_before_admission(llama: Engine) -> None:
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    blocker = GenerationRequest("busy", prompt_for(0), 50)
    waiting = GenerationRequest("busy", prompt_for(1), 50)  # same agent: waits for the first
    llama.submit(blocker, lambda e: None)
    llama.submit(waiting, inbox.put)
    llama.cancel(waiting.request_id)
    events = []
    while not isinstance(event := inbox.get(timeout=30), FinishEvent):
        events.append(event)
    assert event.reason is FinishReason.CANCELLED
    assert event.usage.generated_tokens == 0


def test_stop_string_ends_turn_without_emitting_it(llama: Engine) -> None:
    free = run_turn(llama, GenerationRequest("s", prompt_for(2), 30))
    text = free.text
    assert len(text) > 6, "tiny model produced too little text for this test"
    stop = text[3:6]
    stopped = run_turn(llama, GenerationRequest("s2", prompt_for(2), 30, stop_strings=(stop,)))
    assert stopped.finish.reason is FinishReason.STOP_SEQUENCE
    assert stopped.finish.stop_sequence == stop
    assert stopped.text == text[: text.index(stop)]


def test_prefill_progress_is_reported_in_chunks() -> None:
    engine = make_engine("llama", prefill_step=16)
    try:
        result = run_turn(engine, GenerationRequest("p", prompt_for(0, 4), 2))
        progress = [(e.done, e.total) for e in result.prefill_events]
        total = len(result.request.prompt_tokens)
        assert progress[0] == (0, total)
        assert [d for d, _ in progress] == sorted(d for d, _ in progress)
        assert len(progress) >= total // 16
    finally:
        engine.stop()


def test_lru_idle_agents_are_evicted_when_pool_is_full() -> None:
    engine = make_engine("llama", blocks=16)
    try:
        for i in range(3):
            run_turn(engine, GenerationRequest(f"lru-{i}", prompt_for(i, 4), 8))
        snap = engine.fresh_snapshot()
        assert snap.pool.total_blocks == 16
        tiers = {a.agent_id: a.tier for a in snap.agents}
        assert tiers["lru-0"] == "cold", tiers
        assert tiers["lru-2"] == "hot"
        assert snap.tiers.evictions_total["cold"] >= 1
    finally:
        engine.stop()


def test_pinned_agents_are_not_evicted_and_exhaustion_is_reported() -> None:
    engine = make_engine("llama", blocks=16)
    try:
        run_turn(engine, GenerationRequest("pinned", prompt_for(0, 5), 30))
        engine.call(lambda e: e.ops.pin_agent("pinned", True)).result()
        used = engine.fresh_snapshot().pool.used_blocks
        assert used >= 8
        big = run_turn(engine, GenerationRequest("other", prompt_for(1, 5), 4))
        assert big.finish.reason is FinishReason.ERROR
        assert big.finish.error_type == "rate_limit"
        assert "exhausted" in (big.finish.error or "")
        assert engine.fresh_snapshot().agent("pinned").tier == "hot"
    finally:
        engine.stop()


def test_side_request_that_may_not_evict_a_conversation_says_so() -> None:
    engine = make_engine("llama", blocks=16)
    try:
        run_turn(engine, GenerationRequest("main", prompt_for(0, 5), 30))
        side = run_turn(engine, GenerationRequest("side", prompt_for(1, 5), 4, auxiliary=True))
        assert side.finish.reason is FinishReason.ERROR and side.finish.error_type == "rate_limit"
        assert "a side request may not evict" in (side.finish.error or "")
        assert engine.fresh_snapshot().agent("main").tier == "hot"
    finally:
        engine.stop()


def _engine_in_blocks(blocks: int) -> Engine:
    """A tiny llama's engine with a pool of ``blocks`` blocks and no repetition guard (a random model repeats
    itself, and these tests need answers that run to max_tokens)."""
    loaded = loaded_tiny("llama")
    engine = Engine(loaded, engine_settings(blocks * loaded.spec.block_bytes, repetition_window=0))
    engine.start()
    return engine


def _runs_to(engine: Engine, prompt: tuple[int, ...], n: int) -> None:
    """The test's premise: greedy decoding of ``prompt`` runs ``n`` tokens without an end-of-turn token."""
    assert EOS not in reference_greedy(engine.loaded.model, list(prompt), n, {EOS}), "pick another prompt"


def test_a_side_request_is_served_whole_or_refused_never_cut_short() -> None:
    """A side request may not evict a conversation's cache, so it reserves room for its answer when admitted:
    with room for its prompt but not its answer it is refused with the reason (it used to be admitted and cut
    off a few tokens in, reported as max_tokens); once the room is there it gets every token it asked for."""
    engine = _engine_in_blocks(16)
    block = engine.loaded.spec.block_tokens
    try:
        run_turn(engine, GenerationRequest("main", prompt_for(0, 5), 30))  # 141 positions: 9 of the 16 blocks
        free = engine.fresh_snapshot().pool.free_blocks
        side_prompt = prompt_for(1, 6)[:(free - 1) * block]  # fits the free blocks with one to spare
        _runs_to(engine, side_prompt, 30)
        assert len(side_prompt) + 30 > free * block  # its answer would not
        side = run_turn(engine, GenerationRequest("side", side_prompt, 30, auxiliary=True))
        assert side.finish.reason is FinishReason.ERROR and side.finish.error_type == "rate_limit"
        assert "a side request may not evict" in (side.finish.error or "")
        assert engine.fresh_snapshot().agent("main").tier == "hot"
        engine.call(lambda e: e.ops.evict_agent("main", Tier.COLD)).result()
        side = run_turn(engine, GenerationRequest("side", side_prompt, 30, auxiliary=True))
        assert side.finish.reason is FinishReason.LENGTH
        assert side.tokens == reference_greedy(engine.loaded.model, list(side_prompt), 30, {EOS})
    finally:
        engine.stop()


def test_a_turn_the_full_pool_cuts_short_says_why() -> None:
    engine = _engine_in_blocks(16)
    block = engine.loaded.spec.block_tokens
    try:
        run_turn(engine, GenerationRequest("pinned", prompt_for(0, 5), 30))
        engine.call(lambda e: e.ops.pin_agent("pinned", True)).result()
        free = engine.fresh_snapshot().pool.free_blocks
        prompt = prompt_for(1, 6)[:free * block - 4]  # room for four tokens of its answer
        _runs_to(engine, prompt, 30)
        cut = run_turn(engine, GenerationRequest("other", prompt, 30))
        assert cut.finish.reason is FinishReason.CAPACITY and len(cut.tokens) == 4
        note = engine.fresh_snapshot().agent("other").last_finish_note or ""
        assert f"could not grow the turn past {free * block} positions" in note
        assert "0 of 16 free" in note and "held by running, pinned or busy agents" in note
    finally:
        engine.stop()


def test_request_that_can_never_fit_is_rejected_with_numbers() -> None:
    engine = make_engine("llama", blocks=4)
    try:
        with pytest.raises(RequestTooLargeForPoolError, match=r"needs \d+ KV blocks .* holds 4 blocks"):
            engine.submit(GenerationRequest("x", prompt_for(0, 10), 4), lambda e: None)
        # A side request reserves its answer too: a prompt one block short of the pool fits, its answer does not.
        prompt = prompt_for(0, 10)[:3 * engine.loaded.spec.block_tokens]
        engine.validate(GenerationRequest("x", prompt, 30))
        with pytest.raises(RequestTooLargeForPoolError, match=r"and the 30 answer positions a side request"):
            engine.submit(GenerationRequest("x", prompt, 30, auxiliary=True), lambda e: None)
        with pytest.raises(PromptTooLongError, match=r"prompt is too long: \d+ tokens > 2048 maximum"):
            engine.submit(GenerationRequest("x", (BOS,) * 3000, 4), lambda e: None)
    finally:
        engine.stop()


def test_a_request_is_validated_once_by_the_engine_that_serves_it() -> None:
    """The API validates (and clamps) before it answers; submitting the validated request does not check it again,
    and another engine (a model swapped in) checks it for itself."""
    engine, other = make_engine(), make_engine(blocks=8)
    try:
        asked = GenerationRequest("x", prompt_for(0, 3), 10**6)
        valid = engine.validate(asked)
        assert valid.max_tokens < asked.max_tokens and valid.validated_by
        assert engine.validate(valid) is valid
        assert not GenerationRequest("x", prompt_for(0, 3), 4).validated_by
        with pytest.raises(RequestTooLargeForPoolError):
            other.validate(GenerationRequest("x", prompt_for(0, 40), 4))
        big = engine.validate(GenerationRequest("x", prompt_for(0, 40), 4))
        with pytest.raises(RequestTooLargeForPoolError):
            other.submit(big, lambda e: None)  # validated by another engine: checked here again
        assert run_turn(engine, valid).finish.reason is not None
    finally:
        engine.stop()
        other.stop()


def test_auxiliary_request_leaves_main_cache_intact(llama: Engine) -> None:
    main = run_turn(llama, GenerationRequest("sess", prompt_for(0, 3), 8))
    cached = llama.fresh_snapshot().agent("sess").cached_tokens
    aux_prompt = main.request.prompt_tokens[:20] + tuple(b"write a title")
    aux = run_turn(llama, GenerationRequest("sess", aux_prompt, 4, auxiliary=True))
    # The shared prefix is served from the main cache without trimming it.
    assert aux.finish.usage.reused_tokens == 20
    assert "auxiliary" in (aux.finish.usage.reuse_note or "")
    assert aux.tokens == without_eos(reference_greedy(llama.loaded.model, list(aux_prompt), 4, {EOS}))
    assert llama.fresh_snapshot().agent("sess").cached_tokens == cached
    follow = main.request.prompt_tokens + tuple(main.tokens) + tuple(b"next")
    assert run_turn(llama, GenerationRequest("sess", follow, 4)).finish.usage.reused_tokens == cached


def test_generator_failure_fails_turns_but_engine_survives() -> None:
    calls = {"n": 0}

    def flaky_factory(loaded, limits, hooks):
        generator = sequence_batch_factory(loaded, limits, hooks)
        calls["n"] += 1
        if calls["n"] == 1:

            def explode(plan, room):
                raise RuntimeError("simulated MLX failure")

            generator.step = explode
        return generator

    from tests.support.engine_settings import engine_settings
    from tests.support.tiny_models import loaded_tiny

    engine = Engine(loaded_tiny("llama"), engine_settings(64 << 20, 4, 32), seams=EngineSeams(batch_factory=flaky_factory))
    engine.start()
    try:
        failed = run_turn(engine, GenerationRequest("f", prompt_for(0), 8))
        assert failed.finish.reason is FinishReason.ERROR
        assert "simulated MLX failure" in failed.finish.error
        ok = run_turn(engine, GenerationRequest("f", prompt_for(0), 8))
        assert ok.finish.reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert ok.tokens == without_eos(reference_greedy(engine.loaded.model, list(prompt_for(0)), 8, {EOS}))
    finally:
        engine.stop()


def test_submit_after_stop_is_refused() -> None:
    engine = make_engine("llama")
    engine.stop()
    with pytest.raises(EngineUnavailableError):
        engine.submit(GenerationRequest("x", prompt_for(0), 4), lambda e: None)


def test_explicit_eviction_and_delete(llama: Engine) -> None:
    run_turn(llama, GenerationRequest("e", prompt_for(0), 4))
    llama.call(lambda e: e.ops.evict_agent("e", Tier.COLD)).result()
    snap = llama.fresh_snapshot()
    assert snap.agent("e").tier == "cold" and snap.pool.used_blocks == 0
    llama.call(lambda e: e.ops.delete_agent("e")).result()
    assert llama.fresh_snapshot().agent("e") is None


def test_snapshot_is_consistent_while_decoding(llama: Engine) -> None:
    stop = threading.Event()
    problems: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            snap = llama.snapshot()
            if snap.pool is not None:
                owned = sum(a.blocks for a in snap.agents)
                if snap.pool.used_blocks + snap.pool.free_blocks != snap.pool.total_blocks:
                    problems.append("used + free != total")
                if owned < snap.pool.used_blocks - snap.pool.shared_blocks - 64:
                    problems.append("agent blocks do not cover the pool")
            time.sleep(0.001)

    thread = threading.Thread(target=reader)
    thread.start()
    run_turns(llama, [GenerationRequest(f"r{i}", prompt_for(i), 20) for i in range(6)])
    stop.set()
    thread.join()
    assert not problems
    snap = llama.fresh_snapshot()
    assert snap.throughput.generated_total >= 6
    assert snap.throughput.requests_total == 6
    assert {a.agent_id for a in snap.agents} >= {f"r{i}" for i in range(6)}


def test_watchers_see_every_event_of_an_agents_turns(llama: Engine) -> None:
    seen: list = []
    llama.watch("watched", seen.append)
    result = run_turn(llama, GenerationRequest("watched", prompt_for(0), 6))
    run_turn(llama, GenerationRequest("other", prompt_for(1), 3))
    llama.fresh_snapshot()
    assert [type(e).__name__ for e in seen] == [type(e).__name__ for e in result.events]
    llama.unwatch("watched", seen.append)
    run_turn(llama, GenerationRequest("watched", prompt_for(0), 2))
    llama.fresh_snapshot()
    assert len(seen) == len(result.events)


def test_a_ready_engine_sets_the_heap_aside_and_a_stopping_one_lets_it_back() -> None:
    """Objects alive when the engine is ready stay out of full collections (engine/platform/heap.py); a
    stopping engine lets them back, so its model's cycles are collected on its own thread."""
    engine = make_engine("llama")
    try:
        assert gc.get_freeze_count() > 1000
    finally:
        engine.stop()
    assert gc.get_freeze_count() == 0
