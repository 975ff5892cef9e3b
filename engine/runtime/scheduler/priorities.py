"""Who goes first: each turn's level and place in the order, and the operator's levels and pauses.

A turn's place is its virtual arrival (domain/priority.py): admission takes waiting turns in that order, and
the batch prefills its prompts in it (the sequence carries it as ``rank``). The operator can change an agent's
level or pause it while it runs: its waiting and running turns move at once, and a paused agent's row keeps
its cache and its place in the batch but neither prefills nor decodes until it is resumed.
"""

from __future__ import annotations

from typing import Iterable

from engine.domain.event_log import EventKind
from engine.domain.priority import PriorityPolicy
from engine.runtime import clock
from engine.runtime.scheduler.parts import SchedulerPart, SchedulerState
from engine.runtime.scheduler.turn import Turn, TurnPhase
from engine.runtime.tiers.agents import AgentRecord


class Priorities(SchedulerPart):
    def __init__(self, state: SchedulerState, policy: PriorityPolicy) -> None:
        super().__init__(state)
        self.policy = policy

    # -- turns ---------------------------------------------------------------------------
    def place(self, turn: Turn, agent: AgentRecord) -> None:
        """A submitted turn's level and order."""
        request = turn.request
        level = self.policy.level(request.agent_class, request.priority, agent.priority)
        turn.place(level, self.policy.virtual_arrival(turn.submitted_at, level))

    def in_order(self, turns: Iterable[Turn]) -> list[Turn]:
        """Most urgent first: by virtual arrival, ties by arrival."""
        return sorted(turns, key=lambda t: (t.order, t.submitted_at))

    def admitted(self, turn: Turn) -> None:
        """The turn's sequence enters the batch: it carries the turn's order and its agent's pause."""
        agent = turn.agent
        self._carry(turn)
        if agent is not None and agent.paused:
            self._pause_turn(turn)

    def is_paused(self, turn: Turn) -> bool:
        agent = self.agents.get(turn.request.agent_id)
        return agent is not None and agent.paused

    def queue_positions(self) -> dict[str, int]:
        """Each waiting agent's place in the admission order (1: next)."""
        positions: dict[str, int] = {}
        for turn in self.in_order(self.queues.waiting):
            positions.setdefault(turn.request.agent_id, len(positions) + 1)
        return positions

    # -- the operator --------------------------------------------------------------------
    def set_level(self, agent: AgentRecord, level: int | None) -> None:
        """The operator's level for ``agent`` (None: back to its requests' and class's); its queued and
        running turns move now."""
        agent.set_priority(level)
        for turn in self._turns_of(agent.agent_id):
            self.place(turn, agent)
            if turn.sequence is not None:
                self._carry(turn)
        shown = "its class's" if level is None else str(level)
        self.events.emit(EventKind.ADMIT, f"{agent.agent_id}: priority set to {shown}", agent.agent_id)

    def set_paused(self, agent: AgentRecord, paused: bool) -> None:
        if agent.paused == paused:
            return
        agent.set_paused(paused)
        for turn in self._turns_of(agent.agent_id):
            if turn.sequence is not None:
                self._pause_turn(turn) if paused else self._resume_turn(turn)
        self.events.emit(EventKind.ADMIT, f"{agent.agent_id}: {'paused' if paused else 'resumed'}",
                         agent.agent_id)

    def _carry(self, turn: Turn) -> None:
        """The turn's sequence takes its order and level (the batch prefills by them)."""
        assert turn.sequence is not None
        turn.sequence.rank = turn.order
        turn.sequence.level = turn.level if self.policy.enabled else 0

    def _turns_of(self, agent_id: str) -> list[Turn]:
        return [t for t in self.queues.by_request.values()
                if t.request.agent_id == agent_id and t.phase is not TurnPhase.DONE]

    @staticmethod
    def _pause_turn(turn: Turn) -> None:
        turn.pause(clock.now())

    @staticmethod
    def _resume_turn(turn: Turn) -> None:
        turn.resume(clock.now())
