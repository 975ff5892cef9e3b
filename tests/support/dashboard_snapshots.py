"""Hand-built, fully deterministic EngineSnapshots for the dashboard widget tests.

Every timestamp is fixed and nothing is random, so SVG snapshots of widgets
fed from here are byte-stable across runs and machines.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import MappingProxyType

from engine.domain.block_pool import PoolSnapshot
from engine.domain.requests import FinishEvent, GenerationRequest
from engine.runtime.engine_thread.snapshot import (
    AgentView,
    EngineSnapshot,
    ModelView,
    ThroughputView,
    TierView,
)

from .scripted_engine import ScriptedEngine

MIB = 1 << 20
HYBRID_SPEC = {
    "block_tokens": 16,
    "groups": [{"index": 0, "kind": "global", "layers": [0, 1, 2]}]
    + [{"index": i, "kind": "sliding-512", "layers": [3 * i, 3 * i + 1, 3 * i + 2]} for i in range(1, 6)],
}


def pool_snapshot(owners: list[str | None], groups: list[int | None], *, block_bytes: int = 64 * 1024,
                  n_groups: int = 6, shared: int = 0) -> PoolSnapshot:
    held = Counter(o for o in owners if o is not None)
    return PoolSnapshot(
        total_blocks=len(owners),
        used_blocks=sum(held.values()),
        block_bytes=block_bytes,
        n_groups=n_groups,
        shared_blocks=shared,
        owner_blocks=MappingProxyType(dict(held)),
        block_owner=tuple(owners),
        block_group=tuple(groups),
        # The first ``shared`` used blocks are a prefix two agents hold.
        block_holders=tuple(_holders(owners, shared)),
    )


def _holders(owners: list[str | None], shared: int) -> list[int]:
    holders, left = [], shared
    for owner in owners:
        holders.append(0 if owner is None else (2 if left > 0 else 1))
        left -= owner is not None
    return holders


def hybrid_pool(total: int = 96, used: int = 72, agents: tuple[str, ...] = ("alice", "bob", "erin")) -> PoolSnapshot:
    """Agents take runs of 12 blocks in turn; block i serves layer group i % 6 (0 is global).

    The default agents hash to three different palette colours.
    """
    owners = [agents[(i // 12) % len(agents)] if i < used else None for i in range(total)]
    groups = [i % 6 if i < used else None for i in range(total)]
    return pool_snapshot(owners, groups, shared=3)


def agent_view(agent_id: str, blocks: int, tier: str = "hot") -> AgentView:
    return AgentView(agent_id, None, "tui", "idle", tier, False, "gemma", 16 * blocks, blocks,
                     blocks * 64 * 1024, 2, 0.5, 0.1, 40.0, 0, 0, 0.0, 0.0)


def dashboard_snapshot(pool: PoolSnapshot | None = None, *, decode: float = 123.4, prefill: float = 2345.0,
                       spec: dict | None = None) -> EngineSnapshot:
    pool = pool if pool is not None else hybrid_pool()
    model = ModelView("gemma-3-1b", "gemma-3-1b@0", None, "gemma3", 8192, spec if spec is not None else HYBRID_SPEC)
    throughput = ThroughputView(
        decode_tok_s=decode, prefill_tok_s=prefill, batch_size=3, queue_depth=2, active_requests=5,
        recent_ttft_s=(0.012, 0.5, 1.25), generated_total=12_345, prefilled_total=99_999,
        reused_total=4_567, requests_total=42,
    )
    tiers = TierView(
        hot_agents=3, warm_agents=2, cold_agents=1, hot_bytes=pool.used_bytes, warm_bytes=40 * MIB,
        disk_budget_bytes=1024 * MIB, evictions_total={"warm": 3, "cold": 1}, restores_total=2,
        discards_total=1, evictions_per_min=1.5, restores_per_min=0.5, prefix_hits=3, prefix_misses=1,
    )
    agents = tuple(agent_view(a, n) for a, n in sorted(pool.owner_blocks.items()))
    return EngineSnapshot("ready", model, pool, agents, throughput, tiers, at=0.0)


def throughput_series(n: int = 24) -> list[EngineSnapshot]:
    """Distinct snapshots with a ramp-and-fall decode rate: one sparkline tick each."""
    pool = hybrid_pool()
    rates = [min(i, n - i) * 20.0 for i in range(n)]
    return [dashboard_snapshot(pool, decode=r, prefill=r * 15) for r in rates]


def run_turn(engine: ScriptedEngine, agent_id: str, prompt: str, timeout_s: float = 5.0) -> FinishEvent:
    """Submit one turn and block until its FinishEvent: the scripted engine serves on a thread."""
    done = threading.Event()
    finished: list[FinishEvent] = []

    def sink(event: object) -> None:
        if isinstance(event, FinishEvent):
            finished.append(event)
            done.set()

    engine.submit(GenerationRequest(agent_id, tuple(prompt.encode()), max_tokens=64), sink)
    if not done.wait(timeout_s):
        raise TimeoutError(f"scripted turn for {agent_id} did not finish in {timeout_s}s")
    return finished[0]
