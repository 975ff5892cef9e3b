"""The hot tier: agents' KV blocks in the pool, and how a turn reuses them.

Owns the BlockPool (ids and accounting) and the BlockStore (tensors). All
methods run on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.domain.block_layout import (
    BlockRef,
    Run,
    Span,
    can_trim,
    common_prefix_length,
    plan_growth,
    trim_run,
)
from engine.domain.block_pool import BlockPool
from engine.domain.cache_spec import ModelCacheSpec

from .agents import AgentRecord, Tier
from .kv_blocks import BlockStore, build_prompt_cache, cut_block, eval_blocks, group_source_start


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """How much of a prompt an agent's cache covers, decided before admission."""

    reused: int
    runs: dict[int, Run]
    source: str  # "self", "shared:<agent>", "none"
    note: str | None = None
    donor: str | None = None


@dataclass(slots=True)
class Reservation:
    """Pool blocks held for the tokens a running sequence will add."""

    by_group: dict[int, list[int]] = field(default_factory=dict)

    def count(self, group: int) -> int:
        return len(self.by_group.get(group, ()))

    def take(self, group: int, n: int) -> list[int]:
        ids = self.by_group.get(group, [])
        taken, self.by_group[group] = ids[:n], ids[n:]
        return taken

    def all_ids(self) -> list[int]:
        return [b for ids in self.by_group.values() for b in ids]


class HotCache:
    def __init__(self, spec: ModelCacheSpec, pool: BlockPool) -> None:
        self.spec = spec
        self.pool = pool
        self.store = BlockStore()

    # -- reuse -------------------------------------------------------------------
    def plan_reuse(self, agent: AgentRecord, prompt: tuple[int, ...]) -> ReusePlan:
        """Longest prefix of ``prompt`` the agent's own hot cache can serve."""
        if agent.tier is not Tier.HOT or not agent.tokens:
            return ReusePlan(0, {}, "none")
        k = common_prefix_length(agent.tokens, prompt)
        # The generator needs at least one prompt token to feed.
        k = min(k, len(prompt) - 1)
        if k <= 0:
            return ReusePlan(0, {}, "none", note="cache diverges at the first token")
        if not all(can_trim(agent.runs.get(g.index, Run()), k, g.window) for g in self.spec.groups):
            return ReusePlan(
                0, {}, "none",
                note=f"sliding-window cache cannot be trimmed back to token {k}; full prefill",
            )
        return ReusePlan(k, dict(agent.runs), "self")

    def apply_trim(self, agent: AgentRecord, k: int) -> None:
        """Cut the agent's hot cache back to its first ``k`` tokens, freeing the rest."""
        dropped: list[int] = []
        for group in self.spec.groups:
            run, gone = trim_run(agent.runs.get(group.index, Run()), k)
            agent.runs[group.index] = run
            dropped += gone
        agent.tokens = agent.tokens[:k]
        self._release(agent.agent_id, dropped)
        if k == 0:
            self.drop(agent)

    def build_cache(self, model: Any, agent: AgentRecord) -> list[Any]:
        return build_prompt_cache(model, self.spec, agent.runs, self.store)

    # -- growth -------------------------------------------------------------------
    def blocks_needed(self, agent: AgentRecord, n_tokens: int) -> dict[int, int]:
        """New blocks per group the agent's cache needs to hold ``n_tokens`` tokens."""
        needed = {}
        for group in self.spec.groups:
            run = agent.runs.get(group.index, Run())
            _, spans = plan_growth(run, n_tokens, 0, group.window, self.spec.block_tokens)
            needed[group.index] = len(spans)
        return needed

    def reserve(self, agent_id: str, reservation: Reservation, target: dict[int, int]) -> bool:
        """Grow ``reservation`` to ``target`` blocks per group; all or nothing."""
        extra = {g: n - reservation.count(g) for g, n in target.items() if n > reservation.count(g)}
        if not extra:
            return True
        got = self.pool.allocate(agent_id, extra)
        if got is None:
            return False
        for group, ids in got.items():
            reservation.by_group.setdefault(group, []).extend(ids)
        return True

    def release_reservation(self, agent_id: str, reservation: Reservation) -> None:
        self._release(agent_id, reservation.all_ids())
        reservation.by_group.clear()

    def absorb(
        self, agent: AgentRecord, caches: list[Any], tokens: list[int], reservation: Reservation
    ) -> None:
        """Store a finished sequence's cache as the agent's blocks."""
        n = len(tokens)
        written = []
        for group in self.spec.groups:
            old = agent.runs.get(group.index, Run())
            start = group_source_start(caches, group, n)
            kept, spans = plan_growth(old, n, start, group.window, self.spec.block_tokens)
            ids = self._ids_for(agent.agent_id, reservation, group.index, len(spans))
            new_refs = []
            for block_id, span in zip(ids, spans):
                data = cut_block(caches, group, span, n)
                self.store.put(block_id, data)
                written.append(data)
                new_refs.append(BlockRef(block_id, span.start, span.length))
            kept_ids = set(kept.block_ids)
            self._release(agent.agent_id, [b for b in old.block_ids if b not in kept_ids])
            agent.runs[group.index] = Run(kept.refs + tuple(new_refs))
        eval_blocks(written)
        self.release_reservation(agent.agent_id, reservation)
        agent.tokens = list(tokens)
        agent.tier = Tier.HOT

    def _ids_for(self, owner: str, reservation: Reservation, group: int, n: int) -> list[int]:
        ids = reservation.take(group, n)
        if len(ids) < n:
            more = self.pool.allocate(owner, {group: n - len(ids)})
            if more is None:
                self._release(owner, ids)
                raise MemoryError(f"pool has no room for {n} blocks of group {group}")
            ids += more[group]
        return ids

    # -- removal ------------------------------------------------------------------
    def drop(self, agent: AgentRecord) -> int:
        """Free every block of the agent's hot cache; returns blocks returned to the pool."""
        ids = agent.hot_block_ids()
        freed = self._release(agent.agent_id, ids)
        agent.runs = {}
        agent.tokens = []
        return freed

    def _release(self, owner: str, block_ids: list[int]) -> int:
        if not block_ids:
            return 0
        before = set(block_ids)
        freed = self.pool.release(owner, block_ids)
        self.store.discard([b for b in before if self.pool.refcount(b) == 0])
        return freed

    def exclusive_blocks(self, agent: AgentRecord) -> int:
        return self.pool.exclusive_blocks(agent.agent_id)
