"""The cool tier (--kv-bits-at-rest): idle agents quantized in memory before any goes to disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.domain.event_log import EventKind, EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.cache_file import read_header
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.byte_tokenizer import BOS, EOS
from tests.support.reference import reference_greedy
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_engine_batching import without_eos

pytestmark = pytest.mark.unit

POOL_AGENTS = 3  # full-precision agents the pool holds


def notes(i: int) -> tuple[int, ...]:
    facts = " ".join(f"item {k} of agent {i} weighs {k * 7 + i} kg." for k in range(7))
    return (BOS, *facts.encode())


def engine_on(root: Path | None, kv_bits: int | None = 8, persist: bool = True) -> Engine:
    loaded = loaded_tiny("llama-hd64")
    blocks = loaded.spec.total_blocks_for_tokens(len(notes(9)) + 16)
    events = EventLog()
    store = WarmStore(root, stored_model(loaded), 1 << 30, events, kv_bits_at_rest=kv_bits) if root is not None else None
    config = engine_settings(POOL_AGENTS * blocks * loaded.spec.block_bytes, 8, 32, kv_bits_at_rest=kv_bits, persist_on_exit=persist)
    engine = Engine(loaded, config, store=store, events=events)
    engine.start()
    return engine


def ask(engine: Engine, agent: str, prompt: tuple[int, ...], n: int = 8):
    return run_turn(engine, GenerationRequest(agent, prompt, n))


def tiers(engine: Engine) -> dict[str, str]:
    return {a.agent_id: a.tier for a in engine.fresh_snapshot().agents}


def assert_exact_accounting(engine: Engine) -> None:
    """Pool blocks in use are exactly the blocks agents hold; hot bytes are exactly the hot arrays."""
    used, held = engine.call(lambda e: (e.pool.used_blocks,
                                        sum(e.pool.owned_blocks(a.agent_id) for a in e.agents))).result()
    snap = engine.fresh_snapshot()
    assert used == held and snap.tiers.hot_bytes == snap.tiers.hot_array_bytes


def events(engine: Engine, kind: EventKind) -> list[str]:
    return [e.message for e in engine.events.since(0) if e.kind is kind]


def continue_whole(engine: Engine, agent: str, first, more: bytes):
    """The agent's next turn, which must read everything its first turn left cached."""
    prompt = first.request.prompt_tokens + tuple(first.tokens) + tuple(more)
    result = ask(engine, agent, prompt)
    assert result.finish.usage.reused_tokens == len(first.request.prompt_tokens) + first.finish.usage.generated_tokens
    return result


def test_idle_agents_are_cooled_before_any_goes_to_disk(tmp_path: Path) -> None:
    engine = engine_on(tmp_path)
    try:
        for i in range(POOL_AGENTS + 2):
            ask(engine, f"a{i}", notes(i))
        placed = tiers(engine)
        assert list(placed.values()).count("cool") >= 2 and "warm" not in placed.values(), placed
        assert placed["a0"] == "cool" and placed[f"a{POOL_AGENTS + 1}"] == "hot"  # least recently used first
        assert_exact_accounting(engine)
        snap = engine.fresh_snapshot()
        assert snap.tiers.cool_agents == list(placed.values()).count("cool") and snap.tiers.cool_kv_bits == 8
        cool = snap.agent("a0")
        assert cool.blocks >= 1 and cool.cached_tokens > len(notes(0))
        evictions = events(engine, EventKind.EVICT)
        assert any("a0: hot -> cool" in m and "quantized to 8 bits" in m for m in evictions), evictions
    finally:
        engine.stop()


def test_a_cool_agent_comes_back_whole_by_a_dequantize(tmp_path: Path) -> None:
    engine = engine_on(tmp_path)
    try:
        first = ask(engine, "a0", notes(0))
        for i in range(1, POOL_AGENTS + 1):
            ask(engine, f"a{i}", notes(i))
        assert tiers(engine)["a0"] == "cool"
        again = continue_whole(engine, "a0", first, b" What does item 3 weigh?")
        expected = without_eos(reference_greedy(engine.loaded.model, list(again.request.prompt_tokens), 8, {EOS}))
        assert again.tokens == expected  # 8 bits of K/V leave this model's greedy answer as it was
        restores = events(engine, EventKind.RESTORE)
        assert any("a0: cool -> hot" in m for m in restores), restores
        assert tiers(engine)["a0"] == "hot"
        assert_exact_accounting(engine)
    finally:
        engine.stop()


def test_cool_hot_cool_round_trips_keep_exact_accounting(tmp_path: Path) -> None:
    engine = engine_on(tmp_path)
    try:
        ask(engine, "a0", notes(0))
        total = engine.fresh_snapshot().pool.total_blocks
        seen, restored = set(), set()
        for round_trip in range(3):
            hot_blocks = engine.fresh_snapshot().agent("a0").blocks
            engine.call(lambda e: e.ops.evict_agent("a0", Tier.COOL)).result()
            snap = engine.fresh_snapshot()
            cool_blocks = snap.agent("a0").blocks
            # float32 K/V at 8 bits: 1.125 bytes a value against 4, rounded up to whole blocks.
            assert snap.agent("a0").tier == "cool" and cool_blocks <= 0.35 * hot_blocks
            assert snap.pool.free_blocks == total - cool_blocks
            seen.add(cool_blocks)
            state = engine.call(lambda e: e.tiers.ensure_hot(e.agents.get("a0")).value).result()
            snap = engine.fresh_snapshot()
            assert state == "ready" and snap.agent("a0").tier == "hot", round_trip
            # The blocks its tokens need (a turn's spare capacity is not restored), and nothing else held.
            blocks = snap.agent("a0").blocks
            assert blocks <= hot_blocks and snap.pool.free_blocks == total - blocks
            restored.add(blocks)
            assert_exact_accounting(engine)
        assert len(seen) == 1 and len(restored) == 1  # the same sizes every round trip
    finally:
        engine.stop()


def test_cool_agents_spill_to_disk_as_they_are_when_even_cooling_is_not_enough(tmp_path: Path) -> None:
    engine = engine_on(tmp_path)
    try:
        results = {f"a{i}": ask(engine, f"a{i}", notes(i)) for i in range(3 * POOL_AGENTS + 3)}
        placed = tiers(engine)
        assert {"hot", "cool", "warm"} <= set(placed.values()), placed
        spilled = [a for a, tier in placed.items() if tier == "warm"]
        engine.call(lambda e: e._store.flush()).result()
        path = engine.call(lambda e: e._store.entries[spilled[0]].path).result()
        header = read_header(path)
        assert header.format_version == 2 and header.kv_quantization == {"bits": 8, "group_size": 64}
        continue_whole(engine, spilled[0], results[spilled[0]], b" Next?")
        evictions = events(engine, EventKind.EVICT)
        assert any(f"{spilled[0]}: cool -> warm" in m for m in evictions), evictions
        assert_exact_accounting(engine)
    finally:
        engine.stop()


def test_cool_agents_are_written_on_shutdown_and_resume_after_a_restart(tmp_path: Path) -> None:
    engine = engine_on(tmp_path)
    try:
        first = ask(engine, "a0", notes(0))
        engine.call(lambda e: e.ops.evict_agent("a0", Tier.COOL)).result()
        assert tiers(engine)["a0"] == "cool"
    finally:
        engine.stop()
    engine = engine_on(tmp_path)
    try:
        assert tiers(engine)["a0"] == "warm"
        continue_whole(engine, "a0", first, b" Next?")
    finally:
        engine.stop()


def test_without_a_disk_tier_cool_agents_are_dropped_last(tmp_path: Path) -> None:
    engine = engine_on(None)
    try:
        for i in range(3 * POOL_AGENTS + 3):
            ask(engine, f"a{i}", notes(i))
        placed = tiers(engine)
        assert {"hot", "cool", "cold"} <= set(placed.values()), placed
        evictions = events(engine, EventKind.EVICT)
        assert any("cool -> cold" in m for m in evictions) and not any("hot -> cold" in m for m in evictions)
    finally:
        engine.stop()


def test_without_the_setting_no_agent_is_cooled(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, kv_bits=None)
    try:
        for i in range(POOL_AGENTS + 2):
            ask(engine, f"a{i}", notes(i))
        placed = tiers(engine)
        assert "cool" not in placed.values() and "warm" in placed.values(), placed
        assert engine.fresh_snapshot().tiers.cool_kv_bits is None
    finally:
        engine.stop()
