"""The scheduler's state: which turns wait, which run in the batch, and what it has counted.

One object, passed to the parts that act on turns (admission, stepping,
completion), instead of dictionaries each of them keeps in step.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from engine.domain.speculation_tally import SpeculationTally
from engine.runtime.meters import RateMeter, RecentValues
from engine.runtime.scheduler.turn import Turn


@dataclass(slots=True)
class TurnQueues:
    waiting: deque[Turn] = field(default_factory=deque)
    by_uid: dict[int, Turn] = field(default_factory=dict)  # in the batch, by sequence uid
    by_request: dict[str, Turn] = field(default_factory=dict)  # waiting or running, by request id

    def running_agents(self) -> set[str]:
        return {t.request.agent_id for t in self.by_uid.values()}

    def has_waiting(self, agent_id: str) -> bool:
        return any(t.request.agent_id == agent_id for t in self.waiting)

    def running(self, uid: int) -> Turn | None:
        return self.by_uid.get(uid)


@dataclass(slots=True)
class ClassMeter:
    """One agent class's recent service: time to first token, and the gaps between a turn's tokens."""

    ttft: RecentValues = field(default_factory=lambda: RecentValues(256))
    gaps: RecentValues = field(default_factory=lambda: RecentValues(2048))
    turns: int = 0


@dataclass(slots=True)
class SchedulerStats:
    decode: RateMeter = field(default_factory=RateMeter)
    prefill: RateMeter = field(default_factory=RateMeter)
    ttft: RecentValues = field(default_factory=RecentValues)
    reused_total: int = 0
    requests_total: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    # Hits split by where the reused tokens came from: the agent's own cache, or a prefix another
    # agent (or the disk's shared prefixes) held. They answer different questions.
    own_hits: int = 0
    shared_hits: int = 0
    reused_own: int = 0
    reused_shared: int = 0
    # Turns by how they met their agent's cache (forensics.CacheOutcome values).
    outcomes: Counter[str] = field(default_factory=Counter)
    completed: int = 0  # turns finished so far, so the engine can publish right after one ends
    speculation: SpeculationTally = SpeculationTally()  # over every finished turn that speculated
    classes: dict[str, ClassMeter] = field(default_factory=dict)  # by agent class (domain/priority.py)

    def of_class(self, name: str) -> ClassMeter:
        meter = self.classes.get(name)
        if meter is None:
            meter = self.classes[name] = ClassMeter()
        return meter

    def count_reuse(self, turn: Turn) -> None:
        """An admitted turn: how much of its prompt it reused, and from where."""
        self.requests_total += 1
        self.reused_total += turn.reused
        if turn.forensics is not None:
            self.outcomes[turn.forensics.outcome.value] += 1
        if not turn.reused:
            self.cache_misses += 1
            return
        self.cache_hits += 1
        if turn.plan is not None and turn.plan.source == "self":
            self.own_hits += 1
            self.reused_own += turn.reused
        else:
            self.shared_hits += 1
            self.reused_shared += turn.reused
