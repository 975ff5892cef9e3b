"""The hot tier: agents' KV blocks in the pool, and how a turn reuses them.

Owns the BlockPool (ids and accounting) and the BlockStore (tensors). All
methods run on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from engine.domain.block_layout import (
    BlockRef,
    Run,
    can_trim,
    common_prefix_length,
    plan_growth,
    trim_run,
)
from engine.domain.block_pool import BlockPool
from engine.domain.cache_spec import ModelCacheSpec
from engine.domain.prefix_index import PrefixIndex

from .agents import AgentRecord, Tier
from .kv_blocks import BlockData, BlockStore, build_prompt_cache, cut_block, eval_blocks, group_source_start


# Donors whose tokens are compared per admission; they share the same hashed
# prefix, so the first few are as good as any.
MAX_DONORS_CHECKED = 4


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
        self.prefix = PrefixIndex(spec.block_tokens)

    # -- reuse -------------------------------------------------------------------
    def plan_reuse(
        self, agent: AgentRecord, prompt: tuple[int, ...], donors: Callable[[str], AgentRecord | None] | None = None
    ) -> ReusePlan:
        """The longest prefix of ``prompt`` a hot cache can serve: the agent's own, else a donor's.

        ``donors`` looks up other agents for prefix sharing (None disables it).
        The returned plan's runs are already trimmed to ``reused`` tokens.
        """
        own = self._own_plan(agent, prompt)
        if donors is None or own.reused >= len(prompt) - 1:
            return own
        shared = self._shared_plan(agent, prompt, donors)
        return shared if shared is not None and shared.reused > own.reused else own

    def _own_plan(self, agent: AgentRecord, prompt: tuple[int, ...]) -> ReusePlan:
        if agent.tier is not Tier.HOT or not agent.tokens:
            return ReusePlan(0, {}, "none")
        k = self._usable_prefix(agent, prompt)
        if k <= 0:
            return ReusePlan(0, {}, "none", note="cache diverges at the first token")
        if not self._trimmable(agent, k):
            return ReusePlan(
                0, {}, "none", note=f"sliding-window cache cannot be trimmed back to token {k}; full prefill"
            )
        return ReusePlan(k, self._trimmed_runs(agent, k), "self")

    def _shared_plan(
        self, agent: AgentRecord, prompt: tuple[int, ...], donors: Callable[[str], AgentRecord | None]
    ) -> ReusePlan | None:
        best: ReusePlan | None = None
        for donor_id, _ in self.prefix.candidates(prompt, exclude=agent.agent_id)[:MAX_DONORS_CHECKED]:
            donor = donors(donor_id)
            if donor is None or donor.tier is not Tier.HOT:
                continue
            # Hashes nominate; only equal tokens decide.
            k = self._usable_prefix(donor, prompt)
            if k >= self.spec.block_tokens and self._trimmable(donor, k) and (best is None or k > best.reused):
                best = ReusePlan(k, self._trimmed_runs(donor, k), f"shared:{donor_id}", donor=donor_id)
        return best

    def _usable_prefix(self, agent: AgentRecord, prompt: tuple[int, ...]) -> int:
        # The generator needs at least one prompt token to feed.
        return min(common_prefix_length(agent.tokens, prompt), len(prompt) - 1)

    def _trimmable(self, agent: AgentRecord, k: int) -> bool:
        return all(can_trim(agent.runs.get(g.index, Run()), k, g.window) for g in self.spec.groups)

    def _trimmed_runs(self, agent: AgentRecord, k: int) -> dict[int, Run]:
        return {g.index: trim_run(agent.runs.get(g.index, Run()), k)[0] for g in self.spec.groups}

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
        else:
            self.prefix.update(agent.agent_id, agent.tokens)

    def adopt(self, agent: AgentRecord, plan: ReusePlan, donor: AgentRecord) -> None:
        """Replace the agent's cache with references to a donor's prefix blocks (no copy)."""
        self.drop(agent)
        ids = [b for run in plan.runs.values() for b in run.block_ids]
        self.pool.share(ids, agent.agent_id)
        agent.runs = dict(plan.runs)
        agent.tokens = list(donor.tokens[: plan.reused])
        agent.tier = Tier.HOT
        self.prefix.update(agent.agent_id, agent.tokens)

    def build_cache(self, model: Any, runs: dict[int, Run]) -> list[Any]:
        return build_prompt_cache(model, self.spec, runs, self.store)

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
        self.write_blocks(agent, caches, tokens, reservation)
        self.release_reservation(agent.agent_id, reservation)

    def write_blocks(
        self, agent: AgentRecord, caches: list[Any], tokens: list[int], reservation: Reservation
    ) -> None:
        """Make the agent's blocks hold ``tokens`` from ``caches``, taking new blocks from ``reservation``.

        Also used mid-turn (early sharing) with a prefix of the prompt: the blocks
        written then are kept by the turn's final ``absorb``, which only adds the rest.
        """
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
        agent.tokens = list(tokens)
        agent.tier = Tier.HOT
        self.prefix.update(agent.agent_id, agent.tokens)

    def _ids_for(self, owner: str, reservation: Reservation, group: int, n: int) -> list[int]:
        ids = reservation.take(group, n)
        if len(ids) < n:
            more = self.pool.allocate(owner, {group: n - len(ids)})
            if more is None:
                self._release(owner, ids)
                raise MemoryError(f"pool has no room for {n} blocks of group {group}")
            ids += more[group]
        return ids

    def install(self, agent: AgentRecord, tokens: list[int], blocks: dict[int, list[BlockData]]) -> None:
        """Put restored blocks into the pool as the agent's cache (the caller made room)."""
        ids = self.pool.allocate(agent.agent_id, {g: len(b) for g, b in blocks.items()})
        if ids is None:
            raise MemoryError("pool has no room for the restored cache")
        runs = {}
        for group, datas in blocks.items():
            refs = []
            for block_id, data in zip(ids[group], datas):
                self.store.put(block_id, data)
                refs.append(BlockRef(block_id, data.start, data.length))
            runs[group] = Run(tuple(refs))
        agent.runs = runs
        agent.tokens = list(tokens)
        agent.tier = Tier.HOT
        self.prefix.update(agent.agent_id, agent.tokens)

    # -- removal ------------------------------------------------------------------
    def drop(self, agent: AgentRecord) -> int:
        """Free every block of the agent's hot cache; returns blocks returned to the pool."""
        ids = agent.hot_block_ids()
        freed = self._release(agent.agent_id, ids)
        agent.runs = {}
        agent.tokens = []
        self.prefix.remove(agent.agent_id)
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
