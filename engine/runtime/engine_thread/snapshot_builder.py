"""Builds EngineSnapshot values from live engine state (engine thread only).

The engine hands over the parts it reads (:class:`SnapshotSources`), not itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from engine.domain.cache_spec import ModelCacheSpec
from engine.domain.block_pool import BlockPool
from engine.models.loaded import LoadedModel
from engine.runtime.runner.image_embeddings import ImageEmbedder
from engine.runtime.scheduler.scheduler import Scheduler
from engine.runtime.tiers.accounting import held_bytes
from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.runtime.tiers.manager import TierManager
from engine.domain.priority import AgentClass
from engine.runtime.scheduler.queues import ClassMeter
from engine.runtime.engine_thread.snapshot import (
    AgentView,
    ClassView,
    EngineSnapshot,
    ModelView,
    RankView,
    ThroughputView,
    TierView,
    VisionView,
)

@dataclass(frozen=True, slots=True)
class SnapshotSources:
    """What a snapshot is read from."""

    loaded: LoadedModel
    pool: BlockPool
    agents: AgentTable
    tiers: TierManager
    scheduler: Scheduler | None
    backend: dict[str, object]
    sampling_defaults: str
    context_length: int
    rank_reports: tuple[Any, ...]
    memory: dict[str, object] | None = None
    speculation: str = ""


def build_snapshot(sources: SnapshotSources, status: str) -> EngineSnapshot:
    pool = sources.pool
    scheduler = sources.scheduler
    standing = _standing(scheduler)
    agents = tuple(_agent_view(a, sources, standing) for a in sources.agents)
    return EngineSnapshot(
        status=status,
        model=_model_view(sources),
        pool=pool.snapshot(),
        agents=agents,
        throughput=_throughput(sources),
        tiers=_tiers(sources, agents),
        backend=sources.backend,
        ranks=_ranks(sources),
        memory=sources.memory,
    )


def _ranks(sources: SnapshotSources) -> tuple[RankView, ...]:
    shard = sources.loaded.shard
    reports = sources.rank_reports
    if shard is None:
        return ()
    return tuple(RankView(r.rank, shard[1], r.active_bytes, r.peak_bytes) for r in reports)


def _standing(scheduler: Scheduler | None) -> dict[str, tuple[int, int]]:
    """Each agent with a turn queued or running: its turn's level, and its place in the queue (0: running)."""
    if scheduler is None:
        return {}
    positions = scheduler.priorities.queue_positions()
    standing: dict[str, tuple[int, int]] = {}
    for turn in scheduler.queues.by_request.values():
        agent_id = turn.request.agent_id
        standing.setdefault(agent_id, (turn.level, positions.get(agent_id, 0)))
    return standing


def _agent_view(agent: AgentRecord, sources: SnapshotSources,
                standing: dict[str, tuple[int, int]]) -> AgentView:
    """The record's fields a view shares by name (an enum as its value), and what the view computes."""
    return AgentView(**{name: _plain(getattr(agent, name)) for name in SHARED_WITH_RECORD},
                     **_computed(agent, sources, standing))


def _computed(agent: AgentRecord, sources: SnapshotSources,
              standing: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """The view's fields the record does not hold under the same name (``COMPUTED``)."""
    in_pool = agent.tier in (Tier.HOT, Tier.COOL)
    blocks = sources.pool.owned_blocks(agent.agent_id) if in_pool else 0
    hot = agent.tier is Tier.HOT and agent.kv is not None
    return dict(
        blocks=blocks,
        bytes=blocks * sources.pool.block_bytes if in_pool else agent.stored_bytes,
        decode_tok_s=agent.last_decode_tok_s,
        history=tuple(agent.history),
        turn_ends=tuple(end for end in agent.turn_ends if end <= agent.cached_tokens),
        retained_s=agent.retained_for(time.monotonic()),
        checkpoint_bytes=agent.kv.checkpoint_bytes() if hot else 0,
        state_bytes=sources.loaded.spec.state_bytes if hot else 0,
        family=agent.lineage.family,
        parent=agent.lineage.parent,
        priority=standing.get(agent.agent_id, (sources.agents.level_of(agent), 0))[0],
        priority_set=agent.priority is not None,
        queue_position=standing.get(agent.agent_id, (0, 0))[1],
        waiting_on_tool=not agent.is_busy and agent.tool_hold_until > time.monotonic(),
    )


# AgentView's fields computed from the record (_computed); every other field of the view is the record's
# field or property of the same name, so a field added to both is published without a copy to keep.
COMPUTED = frozenset({"blocks", "bytes", "decode_tok_s", "history", "turn_ends", "retained_s", "checkpoint_bytes",
                      "state_bytes", "family", "parent", "priority", "priority_set", "queue_position",
                      "waiting_on_tool"})
SHARED_WITH_RECORD = tuple(f.name for f in fields(AgentView) if f.name not in COMPUTED)


def _plain(value: Any) -> Any:
    """An enum as its value (the view holds names, not the engine's enums)."""
    return value.value if isinstance(value, Enum) else value


def _model_view(sources: SnapshotSources) -> ModelView:
    loaded = sources.loaded
    return ModelView(
        model_id=loaded.model_id,
        identity=loaded.identity.key,
        path=str(loaded.path) if loaded.path else None,
        architecture=loaded.architecture,
        context_length=sources.context_length,
        spec=loaded.spec.describe(),
        sampling_defaults=sources.sampling_defaults,
        speculation=sources.speculation,
        vision=(f"images ({loaded.vision.model_type}, through mlx-vlm)" if loaded.vision is not None
                else f"no: {loaded.vision_note}"),
        hot_kv=loaded.spec.hot_kv_summary(),
    )


def _throughput(sources: SnapshotSources) -> ThroughputView:
    scheduler = sources.scheduler
    if scheduler is None:
        return ThroughputView()
    stats = scheduler.stats
    return ThroughputView(
        decode_tok_s=stats.decode.rate(),
        prefill_tok_s=stats.prefill.rate(),
        batch_size=scheduler.batch_size,
        queue_depth=len(scheduler.waiting),
        active_requests=scheduler.batch_size + len(scheduler.waiting),
        recent_ttft_s=stats.ttft.values(),
        generated_total=stats.decode.total,
        prefilled_total=stats.prefill.total,
        reused_total=stats.reused_total,
        requests_total=stats.requests_total,
        speculation=stats.speculation,
        vision=_vision(scheduler.images),
        classes=tuple(_class_view(name, stats.classes[name]) for name in CLASS_ORDER if name in stats.classes),
        gap_target_s=scheduler.pacer.gap_s if scheduler.pacer.enabled else None,
        paced_prefill_tokens=scheduler.pacer.budget(scheduler.batch_settings.prefill_step_size)
        if scheduler.pacer.enabled else 0,
    )


CLASS_ORDER = tuple(c.value for c in AgentClass)


def _class_view(name: str, meter: ClassMeter) -> ClassView:
    return ClassView(name, meter.turns, meter.ttft.quantile(0.5), meter.ttft.quantile(0.95),
                     meter.gaps.quantile(0.5), meter.gaps.quantile(0.95), meter.gaps.max())


def _vision(images: ImageEmbedder | None) -> VisionView | None:
    if images is None:
        return None
    return VisionView(images.encoded, images.reused, round(images.seconds, 4))


def _tiers(sources: SnapshotSources, agents: tuple[AgentView, ...]) -> TierView:
    scheduler, tiers, store = sources.scheduler, sources.tiers, sources.tiers.store
    spec = sources.loaded.spec
    counts = {t.value: 0 for t in Tier}
    for a in agents:
        counts[a.tier] += 1
    cool_bytes = sum(a.bytes for a in agents if a.tier == Tier.COOL.value)
    return TierView(
        hot_agents=counts["hot"],
        cool_agents=counts["cool"],
        warm_agents=counts["warm"],
        cold_agents=counts["cold"],
        hot_bytes=sources.pool.used_bytes - cool_bytes,
        cool_bytes=cool_bytes,
        cool_kv_bits=tiers.cool.bits if tiers.cool is not None else None,
        hot_array_bytes=held_bytes(sources.agents),
        warm_bytes=store.disk_bytes if store is not None else 0,
        prefix_files=len(store.prefixes.entries) if store is not None else 0,
        prefix_bytes=store.prefixes.disk_bytes if store is not None else 0,
        shared_blocks=sources.pool.shared_blocks,
        disk_budget_bytes=store.disk_budget_bytes if store is not None else 0,
        warm_kv_bits=stored.bits if (stored := store and (store.hot or store.quantization)) else None,
        hot_kv_bits=spec.kv_bits if spec.quantized_groups else None,
        hot_token_bytes=token_bytes(spec),
        full_token_bytes=token_bytes(spec.with_hot_kv(None)),
        evictions_total=dict(tiers.evictions),
        restores_total=tiers.restores,
        discards_total=store.stats.discards if store is not None else 0,
        evictions_per_min=float(tiers.eviction_rate.count()),
        restores_per_min=float(tiers.restore_rate.count()),
        prefix_hits=scheduler.stats.cache_hits if scheduler else 0,
        prefix_misses=scheduler.stats.cache_misses if scheduler else 0,
        own_hits=scheduler.stats.own_hits if scheduler else 0,
        shared_hits=scheduler.stats.shared_hits if scheduler else 0,
        cache_outcomes=tuple(sorted(scheduler.stats.outcomes.items())) if scheduler else (),
    )


def token_bytes(spec: ModelCacheSpec) -> int:
    """One token's K/V over every layer that keeps K/V per token, as the pool holds them."""
    return sum(spec.group_token_bytes(g) * len(g.layers) for g in spec.groups if not g.is_recurrent)
