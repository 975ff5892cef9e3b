"""What every part of the scheduler works on, in one object.

The turns (``TurnQueues``), what is counted (``SchedulerStats``), who hears
of a turn (``Delivery``), the caches (the hot pool, the agent table, the
tiers below it) and the event log. The scheduler builds it once; admission,
turn caches, step room, stepping and completion each take it, rather than
the same seven arguments each, and reads its members by their own names
(``SchedulerPart``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.domain.event_log import EventLog
from engine.runtime.scheduler.delivery import Delivery
from engine.runtime.scheduler.queues import SchedulerStats, TurnQueues
from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.hot import HotCache
from engine.runtime.tiers.manager import TierManager


@dataclass(frozen=True, slots=True)
class SchedulerState:
    hot: HotCache
    agents: AgentTable
    tiers: TierManager
    events: EventLog
    queues: TurnQueues = field(default_factory=TurnQueues)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    delivery: Delivery = field(default_factory=Delivery)


class SchedulerPart:
    """A part of the scheduler: the shared state, and each of its members under its own name."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.queues = state.queues
        self.stats = state.stats
        self.delivery = state.delivery
        self.hot = state.hot
        self.agents = state.agents
        self.tiers = state.tiers
        self.events = state.events
