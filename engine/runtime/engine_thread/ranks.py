"""How the engine loop runs beside other ranks: alone (this process holds the whole model) or in lockstep.

The loop calls its ranks at the same points either way: once at start (agree
on settings, index the warm tier), while it takes inputs (rank 0 records what
the others replay, and every rank exchanges a tick), and after each step (the
digest the next tick compares). :class:`SoleRank` does nothing at those points;
``replica.py``'s :class:`Replica` is the lockstep side. Where the two differ in
policy, ``alone`` says which: alone, the batch keeps time by its own clock, a
failed step fails its turns and the loop goes on, and the machine's memory is
watched; in lockstep every rank must decide alike, so none of that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.startup_index import index_agents
from engine.settings import EngineSettings

if TYPE_CHECKING:
    from engine.runtime.scheduler.scheduler import Scheduler
    from engine.store.warm_store import WarmStore


class Ranks(Protocol):
    alone: bool  # this process holds the whole model (no lockstep)
    is_root: bool  # this rank takes the clients' inputs (rank 0, or alone)
    pause_s: float  # the last tick's pause before the next (0 alone)
    reports: tuple[Any, ...]  # every rank's report from the last tick (none alone)

    def agree_on_settings(self, model_key: str, pool_blocks: int, block_bytes: int, settings: EngineSettings,
                          sampling: str) -> None:
        """At start: every rank runs the same model, pool and settings."""
        ...

    def index_store(self, agents: AgentTable, store: "WarmStore | None", seeds: Iterable[Any],
                    events: EventLog) -> None:
        """At start: the agents of earlier runs (from the warm tier) and from before a swap (``seeds``)."""
        ...

    def seeded(self, request: GenerationRequest) -> GenerationRequest:
        """A request as every rank samples it."""
        ...

    def record(self, kind: str, *args: Any) -> None:
        """Rank 0: an input the other ranks replay at the same point of their loop."""
        ...

    def tick(self, scheduler: "Scheduler", stop: bool) -> bool:
        """After this pass's inputs: True when the run ends now."""
        ...

    def after_step(self, scheduler: "Scheduler", used_blocks: int) -> None:
        """What the ranks compare at the next tick."""
        ...

    def explain(self, exc: BaseException) -> BaseException:
        """Why the loop broke, as the ranks see it (a rank lost, ranks diverged)."""
        ...


class SoleRank:
    """The engine alone: nobody to agree with, record for or wait on."""

    alone = True
    is_root = True
    pause_s = 0.0
    reports: tuple[Any, ...] = ()

    def agree_on_settings(self, model_key: str, pool_blocks: int, block_bytes: int, settings: EngineSettings,
                          sampling: str) -> None:
        pass

    def index_store(self, agents: AgentTable, store: "WarmStore | None", seeds: Iterable[Any],
                    events: EventLog) -> None:
        index_agents(agents, store, seeds, events)

    def seeded(self, request: GenerationRequest) -> GenerationRequest:
        return request

    def record(self, kind: str, *args: Any) -> None:
        pass

    def tick(self, scheduler: "Scheduler", stop: bool) -> bool:
        return stop

    def after_step(self, scheduler: "Scheduler", used_blocks: int) -> None:
        pass

    def explain(self, exc: BaseException) -> BaseException:
        return exc
