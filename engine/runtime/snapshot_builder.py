"""Builds EngineSnapshot values from live engine state (engine thread only)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .accounting import held_bytes
from .agents import AgentRecord, Tier
from .snapshot import AgentView, EngineSnapshot, ModelView, RankView, ThroughputView, TierView

if TYPE_CHECKING:
    from .engine import Engine


def build_snapshot(engine: "Engine", status: str) -> EngineSnapshot:
    pool = engine.pool
    agents = tuple(_agent_view(a, engine) for a in engine.agents)
    return EngineSnapshot(
        status=status,
        model=_model_view(engine),
        pool=pool.snapshot(),
        agents=agents,
        throughput=_throughput(engine),
        tiers=_tiers(engine, agents),
        backend=engine.backend_info() if hasattr(engine, "backend_info") else {},
        ranks=_ranks(engine),
    )


def _ranks(engine: "Engine") -> tuple[RankView, ...]:
    shard = engine.loaded.shard
    reports = engine.rank_reports
    if shard is None:
        return ()
    return tuple(RankView(r.rank, shard[1], r.active_bytes, r.peak_bytes) for r in reports)


def _agent_view(agent: AgentRecord, engine: "Engine") -> AgentView:
    in_pool = agent.tier in (Tier.HOT, Tier.COOL)
    blocks = engine.pool.owned_blocks(agent.agent_id) if in_pool else 0
    nbytes = blocks * engine.pool.block_bytes if in_pool else agent.stored_bytes
    return AgentView(
        agent_id=agent.agent_id,
        display_name=agent.display_name,
        source=agent.source.value,
        state=agent.state.value,
        tier=agent.tier.value,
        pinned=agent.pinned,
        model_id=agent.model_id,
        cached_tokens=agent.cached_tokens,
        blocks=blocks,
        bytes=nbytes,
        turns=agent.turns,
        reuse_ratio=agent.reuse_ratio,
        last_ttft_s=agent.last_ttft_s,
        decode_tok_s=agent.last_decode_tok_s,
        prefill_done=agent.prefill_done,
        prefill_total=agent.prefill_total,
        last_used=agent.last_used,
        created_at=agent.created_at,
        last_finish=agent.last_finish,
        last_finish_note=agent.last_finish_note,
        history=tuple(agent.history),
        turn_ends=tuple(end for end in agent.turn_ends if end <= agent.cached_tokens),
        retained_s=agent.retained_for(time.monotonic()),
    )


def _model_view(engine: "Engine") -> ModelView:
    loaded = engine.loaded
    return ModelView(
        model_id=loaded.model_id,
        identity=loaded.identity.key,
        path=str(loaded.path) if loaded.path else None,
        architecture=loaded.architecture,
        context_length=engine.context_length,
        spec=loaded.spec.describe(),
        sampling_defaults=engine.sampling_defaults.describe() if hasattr(engine, "sampling_defaults") else "",
    )


def _throughput(engine: "Engine") -> ThroughputView:
    runner = engine.runner
    if runner is None:
        return ThroughputView()
    stats = runner.stats
    return ThroughputView(
        decode_tok_s=stats.decode.rate(),
        prefill_tok_s=stats.prefill.rate(),
        batch_size=runner.batch_size,
        queue_depth=len(runner.waiting),
        active_requests=runner.batch_size + len(runner.waiting),
        recent_ttft_s=stats.ttft.values(),
        generated_total=stats.decode.total,
        prefilled_total=stats.prefill.total,
        reused_total=stats.reused_total,
        requests_total=stats.requests_total,
    )


def _tiers(engine: "Engine", agents: tuple[AgentView, ...]) -> TierView:
    runner, tiers, store = engine.runner, engine.tiers, engine.tiers.store
    counts = {t.value: 0 for t in Tier}
    for a in agents:
        counts[a.tier] += 1
    cool_bytes = sum(a.bytes for a in agents if a.tier == Tier.COOL.value)
    return TierView(
        hot_agents=counts["hot"],
        cool_agents=counts["cool"],
        warm_agents=counts["warm"],
        cold_agents=counts["cold"],
        hot_bytes=engine.pool.used_bytes - cool_bytes,
        cool_bytes=cool_bytes,
        cool_kv_bits=tiers.cool.bits if tiers.cool is not None else None,
        hot_array_bytes=held_bytes(engine.agents),
        warm_bytes=store.disk_bytes if store is not None else 0,
        prefix_files=len(store.prefixes.entries) if store is not None else 0,
        prefix_bytes=store.prefixes.disk_bytes if store is not None else 0,
        shared_blocks=engine.pool.shared_blocks,
        disk_budget_bytes=store.disk_budget_bytes if store is not None else 0,
        warm_kv_bits=store.quantization.bits if store is not None and store.quantization else None,
        evictions_total=dict(tiers.evictions),
        restores_total=tiers.restores,
        discards_total=store.stats.discards if store is not None else 0,
        evictions_per_min=float(tiers.eviction_rate.count()),
        restores_per_min=float(tiers.restore_rate.count()),
        prefix_hits=runner.stats.cache_hits if runner else 0,
        prefix_misses=runner.stats.cache_misses if runner else 0,
        own_hits=runner.stats.own_hits if runner else 0,
        shared_hits=runner.stats.shared_hits if runner else 0,
        cache_outcomes=tuple(sorted(runner.stats.outcomes.items())) if runner else (),
    )
