"""What every part of the scheduler works on, in one object.

The turns (``TurnQueues``), what is counted (``SchedulerStats``), who hears
of a turn (``Delivery``), the caches (the hot pool, the agent table, the
tiers below it) and the event log. The scheduler builds it once; admission,
turn caches, step room, stepping and completion each take it, rather than
the same seven arguments each.
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
