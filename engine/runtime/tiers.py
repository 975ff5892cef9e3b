"""Moving agents between tiers: hot (pool) -> warm (disk) -> cold (metadata).

Without a warm store (``store=None``) eviction drops caches straight to cold.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

from .agent_table import AgentTable
from .agents import AgentRecord, Tier
from .event_log import EventKind, EventLog
from .hot_cache import HotCache
from .kv.sequence_kv import SequenceKV
from .meters import RateMeter

if TYPE_CHECKING:
    from engine.store.warm_store import Loaded, WarmStore


class HotState(enum.Enum):
    READY = "ready"  # hot (or nothing to restore): go ahead
    PENDING = "pending"  # the disk read is still running
    NO_ROOM = "no_room"  # restored data does not fit the pool right now


class TierManager:
    def __init__(self, hot: HotCache, agents: AgentTable, events: EventLog, store: "WarmStore | None" = None) -> None:
        self.hot = hot
        self.agents = agents
        self.events = events
        self.store = store
        self.evictions: dict[str, int] = {"warm": 0, "cold": 0}
        self.restores = 0
        # Per-minute rates for the workbench's tier pane.
        self.eviction_rate = RateMeter(window_s=60.0)
        self.restore_rate = RateMeter(window_s=60.0)

    # -- eviction ---------------------------------------------------------------------
    def make_room(self, free_blocks: int, protect: set[str], auxiliary_only: bool = False) -> bool:
        """Free pool blocks until ``free_blocks`` are free: idle agents' checkpoints first, then
        least-recently-used idle agents go to disk."""
        victims = self.agents.eviction_order(protect, auxiliary_only)
        for agent in victims:
            while self.hot.pool.free_blocks < free_blocks and self.hot.drop_checkpoint(agent):
                pass
        while self.hot.pool.free_blocks < free_blocks:
            victims = self.agents.eviction_order(protect, auxiliary_only)
            if not victims:
                return False
            self.evict(victims[0], Tier.WARM, reason="pool needs room")
        return True

    def evict(self, agent: AgentRecord, tier: Tier, reason: str) -> None:
        if agent.tier is Tier.HOT:
            self._evict_hot(agent, tier, reason)
        elif agent.tier is Tier.WARM and tier is Tier.COLD:
            self._to_cold(agent, f"warm -> cold ({reason})")

    def _evict_hot(self, agent: AgentRecord, tier: Tier, reason: str) -> None:
        agent.stored_tokens = len(agent.tokens)
        if tier is Tier.WARM and self.store is not None and self.store.usable:
            agent.stored_bytes = self.store.spill(agent, self.hot)
            agent.tier = Tier.WARM
            self.evictions["warm"] += 1
            self.eviction_rate.add(1)
            self.hot.drop(agent)
            self.events.emit(
                EventKind.EVICT, f"{agent.agent_id}: hot -> warm, {agent.stored_tokens} tokens ({reason})", agent.agent_id
            )
            return
        self.hot.drop(agent)
        self._to_cold(agent, f"hot -> cold ({reason})")

    def _to_cold(self, agent: AgentRecord, message: str) -> None:
        if self.store is not None:
            self.store.forget(agent.agent_id)
            self.store.remember_cold(agent)
        agent.tier = Tier.COLD
        agent.stored_bytes = 0
        self.evictions["cold"] += 1
        self.eviction_rate.add(1)
        self.events.emit(EventKind.EVICT, f"{agent.agent_id}: {message}", agent.agent_id)

    # -- restore ----------------------------------------------------------------------
    def ensure_hot(self, agent: AgentRecord, protect: set[str] = frozenset()) -> HotState:  # type: ignore[assignment]
        """Bring a warm agent's cache back into the pool without blocking on disk."""
        if agent.tier is not Tier.WARM or self.store is None:
            return HotState.READY
        from engine.store.warm_store import LoadState

        state, loaded = self.store.load(agent.agent_id)
        if state is LoadState.PENDING:
            return HotState.PENDING
        if state is LoadState.MISSING or loaded is None:
            agent.tier = Tier.COLD
            self.events.emit(EventKind.DISCARD, f"{agent.agent_id}: warm cache unusable, prefilling its conversation again (only a prefix shared with other agents is reused)", agent.agent_id, logging.WARNING)
            return HotState.READY
        return self._install(agent, loaded, set(protect) | {agent.agent_id})

    def _install(self, agent: AgentRecord, loaded: "Loaded", protect: set[str]) -> HotState:
        own = sum(SequenceKV.empty(self.hot.spec).blocks_for(len(loaded.tokens)).values())
        if own > self.hot.pool.total_blocks:
            # The pool shrank since the cache was written (a smaller budget after a restart): it can
            # never come back whole, and waiting for room would refuse the agent forever.
            assert self.store is not None
            self.store.forget(agent.agent_id)
            self._to_cold(agent, f"warm -> cold: its {len(loaded.tokens)} tokens need {own} blocks, the pool "
                                 f"has {self.hot.pool.total_blocks}")
            return HotState.READY
        need = own + sum(1 for s in loaded.slices if s.checkpoint is not None)  # a slice per checkpoint block
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
                agent.tier = Tier.COLD
                agent.stored_bytes = 0
                self.evictions["cold"] += 1
                self.store.remember_cold(agent)
