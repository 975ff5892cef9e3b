"""Moving agents between tiers: hot (pool) -> warm (disk) -> cold (metadata).

Without a warm store (``store=None``) eviction drops caches straight to cold.
"""

from __future__ import annotations

import logging
from typing import Protocol

from .agent_table import AgentTable
from .agents import AgentRecord, Tier
from .event_log import EventKind, EventLog
from .hot_cache import HotCache


class WarmStore(Protocol):
    """The disk tier, as the engine sees it (engine.store implements it)."""

    def spill(self, agent: AgentRecord, hot: HotCache) -> int: ...
    def restore(self, agent: AgentRecord, hot: HotCache) -> bool: ...
    def forget(self, agent_id: str) -> None: ...


class TierManager:
    def __init__(self, hot: HotCache, agents: AgentTable, events: EventLog, store: WarmStore | None = None) -> None:
        self.hot = hot
        self.agents = agents
        self.events = events
        self.store = store
        self.evictions: dict[str, int] = {"warm": 0, "cold": 0}

    def make_room(self, free_blocks: int, protect: set[str], auxiliary_only: bool = False) -> bool:
        """Evict least-recently-used idle agents until the pool has ``free_blocks`` free."""
        while self.hot.pool.free_blocks < free_blocks:
            victims = self.agents.eviction_order(protect, auxiliary_only)
            if not victims:
                return False
            self.evict(victims[0], Tier.WARM, reason="pool needs room")
        return True

    def evict(self, agent: AgentRecord, tier: Tier, reason: str) -> None:
        if agent.tier is not Tier.HOT:
            if tier is Tier.COLD and agent.tier is Tier.WARM:
                self._to_cold(agent, reason)
            return
        if tier is Tier.WARM and self.store is not None:
            agent.stored_bytes = self.store.spill(agent, self.hot)
            agent.stored_tokens = len(agent.tokens)
            agent.tier = Tier.WARM
            self.evictions["warm"] += 1
            self.events.emit(EventKind.EVICT, f"{agent.agent_id}: hot -> warm ({reason})", agent.agent_id)
        else:
            agent.stored_tokens = len(agent.tokens)
            agent.stored_bytes = 0
            agent.tier = Tier.COLD
            self.evictions["cold"] += 1
            self.events.emit(EventKind.EVICT, f"{agent.agent_id}: hot -> cold ({reason})", agent.agent_id)
        self.hot.drop(agent)

    def _to_cold(self, agent: AgentRecord, reason: str) -> None:
        if self.store is not None:
            self.store.forget(agent.agent_id)
        agent.tier = Tier.COLD
        agent.stored_bytes = 0
        self.evictions["cold"] += 1
        self.events.emit(EventKind.EVICT, f"{agent.agent_id}: warm -> cold ({reason})", agent.agent_id)

    def ensure_hot(self, agent: AgentRecord) -> bool:
        """Bring a warm agent's cache back into the pool. False when it stays unusable."""
        if agent.tier is not Tier.WARM or self.store is None:
            return agent.tier is Tier.HOT
        try:
            restored = self.store.restore(agent, self.hot)
        except MemoryError:
            return False
        if restored:
            agent.tier = Tier.HOT
            self.events.emit(EventKind.RESTORE, f"{agent.agent_id}: warm -> hot ({len(agent.tokens)} tokens)", agent.agent_id)
        else:
            agent.tier = Tier.COLD
            self.events.emit(EventKind.DISCARD, f"{agent.agent_id}: warm cache unusable, full prefill", agent.agent_id, logging.WARNING)
        return restored
