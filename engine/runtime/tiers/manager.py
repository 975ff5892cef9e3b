"""Moving agents between tiers: hot (pool) -> cool (quantized, pool) -> warm (disk) -> cold (metadata).

When the pool needs room, the cheapest agent to bring back goes first, and
the least expensive way: idle agents are cooled (quantized in memory, a
dequantize to bring back) before any is spilled; cool agents, least recently
used first, are spilled to disk (a read to bring back) before a hot agent
that cannot be cooled; without a warm store (``store=None``) eviction drops
caches to cold (a prefill to bring back). Cooling needs ``cool`` (the
--kv-bits-at-rest quantization); without it agents go from hot to warm.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any, Iterable

from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.runtime.tiers import warm
from engine.runtime.tiers.cool import cool_copy
from engine.domain.event_log import EventKind, EventLog
from engine.runtime.tiers.hot import HotCache
from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.runtime.meters import RateMeter

if TYPE_CHECKING:
    from engine.store.cache_file import KVQuantization
    from engine.store.warm_store import Loaded, WarmStore


class HotState(enum.Enum):
    READY = "ready"  # hot (or nothing to restore): go ahead
    PENDING = "pending"  # the disk read is still running
    NO_ROOM = "no_room"  # restored data does not fit the pool right now


class TierManager:
    def __init__(self, hot: HotCache, agents: AgentTable, events: EventLog, store: "WarmStore | None" = None,
                 cool: "KVQuantization | None" = None) -> None:
        self.hot = hot
        self.agents = agents
        self.events = events
        self.store = store
        self.cool = cool
        self.evictions: dict[str, int] = {"warm": 0, "cold": 0} | ({"cool": 0} if cool is not None else {})
        self.restores = 0
        # Per-minute rates for the workbench's tier pane.
        self.eviction_rate = RateMeter(window_s=60.0)
        self.restore_rate = RateMeter(window_s=60.0)

    # -- eviction ---------------------------------------------------------------------
    def make_room(self, free_blocks: int, protect: set[str], auxiliary_only: bool = False,
                  reason: str = "pool needs room") -> bool:
        """Free pool blocks until ``free_blocks`` are free: idle agents' older checkpoints first, then
        least-recently-used idle agents are cooled, then cool ones (else hot ones) go to disk."""
        # Each idle agent keeps its newest checkpoint while it can go to disk with it: its next turn resumes
        # there when the client re-renders the last reply into other tokens (a recurrent state or a sliding
        # window cannot be cut back to the divergence). Reading it back costs less than recomputing the
        # conversation from the shared prefix; without a disk tier an eviction loses it anyway.
        keep = 1 if self.store is not None and self.store.usable else 0
        victims = self.agents.eviction_order(protect, auxiliary_only)
        for agent in victims:
            while self.hot.pool.free_blocks < free_blocks and self.hot.drop_checkpoint(agent, keep):
                pass
        uncoolable: set[str] = set()
        while self.hot.pool.free_blocks < free_blocks:
            victims = self.agents.eviction_order(protect, auxiliary_only)
            coolable = [a for a in victims if self._worth_cooling(a) and a.agent_id not in uncoolable]
            if coolable:
                if not self._cool(coolable[0], reason=reason):
                    uncoolable.add(coolable[0].agent_id)
                continue
            victims = self.agents.cool_order(protect, auxiliary_only) + victims
            if not victims:
                return False
            self.evict(victims[0], Tier.WARM, reason=reason)
        return True

    def evict(self, agent: AgentRecord, tier: Tier, reason: str) -> None:
        if tier is Tier.COOL:
            if agent.tier is Tier.HOT and self.cool is not None:
                self._cool(agent, reason)
        elif agent.tier is Tier.HOT:
            self._evict_hot(agent, tier, reason)
        elif agent.tier is Tier.COOL:
            self._evict_hot(agent, tier, reason, source="cool")
        elif agent.tier is Tier.WARM and tier is Tier.COLD:
            self._to_cold(agent, f"warm -> cold ({reason})")

    # -- cooling --------------------------------------------------------------------------
    def _worth_cooling(self, agent: AgentRecord) -> bool:
        # Auxiliary agents (titles, probes) are not worth keeping: they go straight on. (A recurrent state
        # stays full precision when its agent cools; _cool refuses where that frees nothing.)
        return self.cool is not None and not agent.auxiliary and agent.kv is not None and bool(agent.tokens)

    def _cool(self, agent: AgentRecord, reason: str) -> bool:
        """Quantize the agent's cache in memory; False (nothing changed) when that frees no block."""
        assert self.cool is not None and agent.kv is not None
        cool = cool_copy(agent, self.cool)
        blocks = cool.pool_blocks(self.hot.pool.block_bytes)
        held = self.hot.exclusive_blocks(agent)
        if blocks >= held:
            return False  # mostly a shared prefix others hold: quantizing frees nothing
        n_tokens = len(agent.tokens)
        self.hot.drop(agent)
        got = self.hot.pool.allocate(agent.agent_id, {0: blocks})
        assert got is not None, "cooling frees more blocks than it takes"
        agent.cooled(got, cool, n_tokens)
        self.evictions["cool"] += 1
        self.eviction_rate.add(1)
        self.events.emit(EventKind.EVICT, f"{agent.agent_id}: hot -> cool, {n_tokens} tokens quantized to "
                         f"{self.cool.bits} bits, {held} -> {blocks} blocks ({reason})", agent.agent_id)
        return True

    def _evict_hot(self, agent: AgentRecord, tier: Tier, reason: str, source: str = "hot") -> None:
        """A hot or cool agent's cache leaves the pool: written to disk, or dropped."""
        n_tokens = len(agent.cool.tokens) if agent.cool is not None else len(agent.tokens)
        agent.stored(n_tokens, agent.stored_bytes)  # (what a warm file or a cold entry records)
        if tier is Tier.WARM and self.store is not None and self.store.usable:
            agent.stored(n_tokens, warm.spill(self.store, agent))
            agent.move_to(Tier.WARM)
            self.evictions["warm"] += 1
            self.eviction_rate.add(1)
            self._drop(agent)
            self.events.emit(
                EventKind.EVICT, f"{agent.agent_id}: {source} -> warm, {agent.stored_tokens} tokens ({reason})",
                agent.agent_id,
            )
            return
        self._drop(agent)
        self._to_cold(agent, f"{source} -> cold ({reason})")

    def _drop(self, agent: AgentRecord) -> None:
        self.hot.drop(agent)
        agent.uncooled()

    def _to_cold(self, agent: AgentRecord, message: str) -> None:
        if self.store is not None:
            self.store.forget(agent.agent_id)
            self.store.remember_cold(warm.cold_entry(agent))
        agent.went_cold()
        self.evictions["cold"] += 1
        self.eviction_rate.add(1)
        self.events.emit(EventKind.EVICT, f"{agent.agent_id}: {message}", agent.agent_id)

    # -- restore ----------------------------------------------------------------------
    def ensure_hot(self, agent: AgentRecord, protect: set[str] = frozenset()) -> HotState:  # type: ignore[assignment]
        """Bring a cool agent's cache back to full precision, or a warm one's into the pool without
        blocking on disk."""
        if agent.tier is Tier.COOL:
            return self._warm_up(agent, set(protect) | {agent.agent_id})
        if agent.tier is not Tier.WARM or self.store is None:
            return HotState.READY
        from engine.store.warm_store import LoadState

        state, loaded = self.store.load(agent.agent_id)
        if state is LoadState.PENDING:
            return HotState.PENDING
        if state is LoadState.MISSING or loaded is None:
            agent.move_to(Tier.COLD)
            self.events.emit(EventKind.DISCARD, f"{agent.agent_id}: warm cache unusable, prefilling its conversation again (only a prefix shared with other agents is reused)", agent.agent_id, logging.WARNING)
            return HotState.READY
        return self._install(agent, loaded, set(protect) | {agent.agent_id})

    def _warm_up(self, agent: AgentRecord, protect: set[str]) -> HotState:
        """Cool -> hot: dequantize into the pool. Its cool blocks are freed as the cache is installed,
        so the room to make is what it needs beyond them; without it the agent stays cool."""
        cool = agent.cool
        assert cool is not None
        need = self._blocks_for(len(cool.tokens)) + self._checkpoint_blocks(cool.blocks)
        held = sum(len(ids) for ids in agent.blocks.values())
        if not self.make_room(need - held, protect):
            return HotState.NO_ROOM
        if not self.hot.install(agent, cool.tokens, cool.slices(), cool.checkpoints):
            # install released the cool blocks; they are still free (nothing ran in between).
            got = self.hot.pool.allocate(agent.agent_id, {0: held})
            assert got is not None
            agent.take_blocks(got)
            agent.move_to(Tier.COOL)
            return HotState.NO_ROOM
        agent.uncooled()
        self.restores += 1
        self.restore_rate.add(1)
        self.events.emit(EventKind.RESTORE, f"{agent.agent_id}: cool -> hot, {len(agent.tokens)} tokens dequantized",
                         agent.agent_id)
        return HotState.READY

    def _install(self, agent: AgentRecord, loaded: "Loaded", protect: set[str]) -> HotState:
        own = self._blocks_for(len(loaded.tokens))
        if own > self.hot.pool.total_blocks:
            # The pool shrank since the cache was written (a smaller budget after a restart): it can
            # never come back whole, and waiting for room would refuse the agent forever.
            assert self.store is not None
            self.store.forget(agent.agent_id)
            self._to_cold(agent, f"warm -> cold: its {len(loaded.tokens)} tokens need {own} blocks, the pool "
                                 f"has {self.hot.pool.total_blocks}")
            return HotState.READY
        need = own + self._checkpoint_blocks(loaded.slices)
        if not self.make_room(need, protect):
            return HotState.NO_ROOM
        if not self.hot.install(agent, loaded.tokens, loaded.slices, loaded.checkpoints):
            return HotState.NO_ROOM
        assert self.store is not None
        self.store.installed(agent.agent_id)
        self.restores += 1
        self.restore_rate.add(1)
        source = "memory" if loaded.from_memory else "disk"  # type: ignore[attr-defined]
        self.events.emit(
            EventKind.RESTORE, f"{agent.agent_id}: warm -> hot from {source}, {len(agent.tokens)} tokens", agent.agent_id
        )
        return HotState.READY

    def _checkpoint_blocks(self, runs: "Iterable[Any]") -> int:
        """Pool blocks the checkpoints among ``runs`` (slices or blocks at rest, one per block) take."""
        groups = self.hot.spec.groups
        return sum(self.hot.spec.group_units(groups[r.group]) for r in runs if r.checkpoint is not None)

    def _blocks_for(self, n_tokens: int) -> int:
        """Pool blocks a restored cache of ``n_tokens`` takes (a checkpoint block takes one more each)."""
        return sum(SequenceKV.empty(self.hot.spec).blocks_for(n_tokens).values())

    def prefetch(self, agent: AgentRecord) -> None:
        if agent.tier is Tier.WARM and self.store is not None:
            self.store.prefetch(agent.agent_id)

    # -- the engine loop's hook -----------------------------------------------------------
    def poll(self) -> None:
        if self.store is None:
            return
        self.store.poll()
        for agent_id in self.store.take_went_cold():
            agent = self.agents.get(agent_id)
            if agent is not None and agent.tier is Tier.WARM:
                agent.went_cold()
                self.evictions["cold"] += 1
                self.store.remember_cold(warm.cold_entry(agent))
