"""The engine snapshot again, from the JSON of ``GET /v1/stats`` (or a ``stats`` frame of ``/v1/stream``).

An attached workbench draws the same panes as the embedded one, and the panes
read :class:`EngineSnapshot`. The stats body carries the snapshot's own view
dataclasses (agents, tiers, throughput, ranks) as they are, and renames or
reshapes only the model (``cache_spec``) and the pool (its per-block map under
``block_map``); this module undoes exactly that, so an attached pane sees what
an embedded one would. A test rebuilds a live engine's snapshot from its stats
and compares the two field for field: a new field the stats drop fails it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import TypeAdapter

from engine.domain.block_pool import PoolSnapshot
from engine.runtime.engine_thread.snapshot import AgentView, EngineSnapshot, ModelView, RankView, ThroughputView, TierView


@cache
def _adapter(kind: type) -> TypeAdapter:
    return TypeAdapter(kind)


def _read(kind: type, value: Any) -> Any:
    return _adapter(kind).validate_python(value)


def snapshot_from_stats(stats: dict[str, Any]) -> EngineSnapshot:
    """The :class:`EngineSnapshot` that ``stats`` was built from (its pool's block map only where the stats
    carried one: ``?blocks=true``)."""
    return EngineSnapshot(
        status=stats["status"],
        model=_model(stats.get("model")),
        pool=_pool(stats.get("pool")),
        agents=tuple(_read(AgentView, agent) for agent in stats.get("agents", ())),
        throughput=_read(ThroughputView, stats.get("throughput") or {}),
        tiers=_read(TierView, stats.get("tiers") or {}),
        backend=dict(stats.get("backend") or {}),
        at=stats.get("at", 0.0),
        detail=stats.get("detail"),
        ranks=tuple(_read(RankView, rank) for rank in stats.get("ranks", ())),
        memory=stats.get("memory"),
    )


def _model(model: dict[str, Any] | None) -> ModelView | None:
    if model is None:
        return None
    fields = dict(model)
    fields["spec"] = fields.pop("cache_spec")
    return _read(ModelView, fields)


def _pool(pool: dict[str, Any] | None) -> PoolSnapshot | None:
    if pool is None:
        return None
    blocks = pool.get("block_map") or {"owners": (), "groups": (), "holders": ()}
    holders = tuple(tuple(ids) for ids in blocks.get("holders", ()))
    return PoolSnapshot(
        total_blocks=pool["total_blocks"], used_blocks=pool["used_blocks"], block_bytes=pool["block_bytes"],
        n_groups=pool["n_groups"], shared_blocks=pool["shared_blocks"], owner_blocks=dict(pool["owner_blocks"]),
        block_owner=tuple(blocks["owners"]), block_group=tuple(blocks["groups"]),
        block_holders=tuple(len(ids) for ids in holders), block_holder_ids=holders,
    )
