"""All agents the engine knows, with an LRU order for eviction."""

from __future__ import annotations

import itertools
import time
from typing import Iterator

from engine.domain.priority import PriorityPolicy
from engine.runtime import clock
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.domain.requests import GenerationRequest


class AgentTable:
    def __init__(self, policy: PriorityPolicy = PriorityPolicy()) -> None:
        self._agents: dict[str, AgentRecord] = {}
        # Each agent's level: a less urgent agent's idle caches go before a more urgent one's.
        self.policy = policy
        self._tick = itertools.count(1)

    def __contains__(self, agent_id: str) -> bool:
        return agent_id in self._agents

    def __iter__(self) -> Iterator[AgentRecord]:
        return iter(list(self._agents.values()))

    def __len__(self) -> int:
        return len(self._agents)

    def get(self, agent_id: str) -> AgentRecord | None:
        return self._agents.get(agent_id)

    def add(self, record: AgentRecord) -> AgentRecord:
        self._agents[record.agent_id] = record
        return record

    def for_request(self, request: GenerationRequest) -> AgentRecord:
        record = self._agents.get(request.agent_id)
        if record is None:
            record = self.add(AgentRecord(request.agent_id, request.source, request.display_name))
        record.identify(request.display_name, request.agent_class, request.lineage, request.priority)
        return record

    def remove(self, agent_id: str) -> AgentRecord | None:
        return self._agents.pop(agent_id, None)

    def touch(self, record: AgentRecord) -> None:
        record.touch(next(self._tick))

    def cool_order(self, protect: set[str], auxiliary_only: bool = False) -> list[AgentRecord]:
        """Cool, idle, unpinned agents in the order :meth:`eviction_order` gives hot ones."""
        return self._idle_in(Tier.COOL, protect, auxiliary_only)

    def eviction_order(self, protect: set[str], auxiliary_only: bool = False) -> list[AgentRecord]:
        """Hot, idle, unpinned agents in the order they go: auxiliary agents, then agents without a live
        retention (a client's cache_control, a tool loop's hold), then retained ones (a last resort, not a
        pin); within each, the least urgent level first, then the least recently used."""
        return self._idle_in(Tier.HOT, protect, auxiliary_only)

    def _idle_in(self, tier: Tier, protect: set[str], auxiliary_only: bool) -> list[AgentRecord]:
        candidates = [
            a
            for a in self._agents.values()
            if a.tier is tier
            and not a.is_busy
            and not a.pinned
            and a.agent_id not in protect
            and (a.auxiliary or not auxiliary_only)
        ]
        now = clock.now()
        return sorted(candidates, key=lambda a: (not a.auxiliary, a.retained_until > now, -self.level_of(a),
                                                 a.lru_tick))

    def most_urgent_expected(self, within_s: float) -> int | None:
        """The most urgent level among idle agents likely to send a turn soon: one whose reply was a tool call
        (its client is running the tool, ``retain``'s hold), or one that started a turn in the last ``within_s``
        seconds (a person reading its reply, a client between steps); None: no such agent."""
        now, wall = clock.now(), time.time()
        levels = [self.level_of(a) for a in self._agents.values()
                  if not a.is_busy and (a.tool_hold_until > now or wall - a.last_used < within_s)]
        return min(levels, default=None)

    def level_of(self, agent: AgentRecord) -> int:
        """The agent's standing level: the operator's setting, else what its latest request asked, else its
        class's."""
        return self.policy.level(agent.agent_class, agent.asked_priority, agent.priority)
