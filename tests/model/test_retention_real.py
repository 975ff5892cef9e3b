"""A cache_control breakpoint with a 1h TTL on the real SmolLM2: the marked agent is the least
recently used, yet when the pool needs room the unmarked agents are evicted before it, and it
continues from its hot cache."""

from __future__ import annotations

from pathlib import Path

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.model.engine_fixtures import start_engine
from tests.model.test_engine_real import raw_prompt

POOL_BLOCKS = 5  # two agents of two blocks each fit; a third needs an eviction


def long_prompt(loaded, name: str) -> tuple[int, ...]:
    # Raw text with a distinct first word: no agent shares another's prefix (a donor is protected
    # while it donates, which would decide the eviction instead of the retention).
    facts = " ".join(f"item {k} is {k * 7 % 101}." for k in range(50))
    return raw_prompt(loaded, f"{name.capitalize()} notes: {facts}")


def test_a_one_hour_breakpoint_keeps_an_idle_agent_hot_while_unmarked_agents_go_first(
    smollm2, tmp_path: Path,
) -> None:
    block_mib = smollm2.spec.block_bytes / 2**20
    store = WarmStore(tmp_path, stored_model(smollm2), 1 << 30, EventLog())
    engine = start_engine(smollm2, budget_mb=(POOL_BLOCKS + 0.5) * block_mib, store=store)
    try:
        assert engine.fresh_snapshot().pool.total_blocks == POOL_BLOCKS
        prompts = {name: long_prompt(smollm2, name) for name in ("kept", "plain-1", "plain-2", "plain-3")}
        assert all(256 < len(p) < 500 for p in prompts.values())
        run_turn(engine, GenerationRequest("kept", prompts["kept"], 8, retain_s=3600.0, retain_tokens=100))
        tiers = []
        for name in ("plain-1", "plain-2", "plain-3"):
            run_turn(engine, GenerationRequest(name, prompts[name], 8))
            snapshot = engine.fresh_snapshot()
            tiers.append({a.agent_id: a.tier for a in snapshot.agents})
        # Each new agent needed room: the unmarked agent before it went, never the marked one.
        assert tiers[0] == {"kept": "hot", "plain-1": "hot"}
        events = [e.message for e in engine.events.since(0)]
        assert tiers[1] == {"kept": "hot", "plain-1": "warm", "plain-2": "hot"}, "\n".join(events)
        assert tiers[2] == {"kept": "hot", "plain-1": "warm", "plain-2": "warm", "plain-3": "hot"}
        kept = engine.fresh_snapshot().agent("kept")
        assert 3000 < kept.retained_s <= 3600

        # The marked agent's next turn starts from its hot cache.
        again = run_turn(engine, GenerationRequest("kept", prompts["kept"] + prompts["plain-1"][-20:], 8))
        assert again.finish.usage.reuse_source == "self"
        assert again.finish.usage.reused_tokens >= len(prompts["kept"]) - 1
    finally:
        engine.stop()
