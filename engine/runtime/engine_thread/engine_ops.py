"""Engine-thread operations that change engine state, as data, so they can be sent between ranks.

``Engine.call`` runs any function on the engine thread. A function that
changes what the engine holds (evict, pin, delete, fork, rewind, import) must
be an :class:`EngineOp`: under a sharded model rank 0 sends it to the other
ranks, which apply it at the same point (engine/distributed/lockstep.py). A
plain function runs on rank 0 alone and may only read. Each op is a small
frozen record of its arguments that calls one method of the engine's
``AgentOps`` (agent_ops.py): the set of ops is the set of classes here, typed,
and the engine's own methods are not a wire protocol.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.domain.requests import AgentSource
from engine.runtime.tiers.agents import Tier
from engine.runtime.tiers.branching import Branch

if TYPE_CHECKING:
    from engine.runtime.engine_thread.agent_ops import AgentOps


class EngineOp(ABC):
    """One command the engine thread applies to its agents (and every rank replays)."""

    __slots__ = ()

    @abstractmethod
    def apply(self, ops: "AgentOps") -> Any:
        """Run the command on the engine thread's ``AgentOps``."""

    def __call__(self, engine: Any) -> Any:
        return self.apply(engine.ops)


@dataclass(frozen=True, slots=True)
class EvictAgent(EngineOp):
    agent_id: str
    tier: Tier

    def apply(self, ops: "AgentOps") -> None:
        return ops.evict_agent(self.agent_id, self.tier)


@dataclass(frozen=True, slots=True)
class EvictIdle(EngineOp):
    tier: Tier = Tier.WARM

    def apply(self, ops: "AgentOps") -> int:
        return ops.evict_idle(self.tier)


@dataclass(frozen=True, slots=True)
class PinAgent(EngineOp):
    agent_id: str
    pinned: bool

    def apply(self, ops: "AgentOps") -> None:
        return ops.pin_agent(self.agent_id, self.pinned)


@dataclass(frozen=True, slots=True)
class DeleteAgent(EngineOp):
    agent_id: str

    def apply(self, ops: "AgentOps") -> None:
        return ops.delete_agent(self.agent_id)


@dataclass(frozen=True, slots=True)
class SetAgentPriority(EngineOp):
    agent_id: str
    level: int | None

    def apply(self, ops: "AgentOps") -> None:
        return ops.set_agent_priority(self.agent_id, self.level)


@dataclass(frozen=True, slots=True)
class PauseAgent(EngineOp):
    agent_id: str
    paused: bool

    def apply(self, ops: "AgentOps") -> None:
        return ops.pause_agent(self.agent_id, self.paused)


@dataclass(frozen=True, slots=True)
class HoldAgent(EngineOp):
    agent_id: str
    seconds: float

    def apply(self, ops: "AgentOps") -> None:
        return ops.hold_agent(self.agent_id, self.seconds)


@dataclass(frozen=True, slots=True)
class ForkAgent(EngineOp):
    source_id: str
    new_id: str
    turn: int | None = None
    prompt: tuple[int, ...] | None = None
    display_name: str | None = None
    source_kind: AgentSource | None = None

    def apply(self, ops: "AgentOps") -> Branch:
        return ops.fork_agent(self.source_id, self.new_id, self.turn, self.prompt, self.display_name,
                              self.source_kind)


@dataclass(frozen=True, slots=True)
class RewindAgent(EngineOp):
    agent_id: str
    turn: int | None = None
    prompt: tuple[int, ...] | None = None

    def apply(self, ops: "AgentOps") -> Branch:
        return ops.rewind_agent(self.agent_id, self.turn, self.prompt)


@dataclass(frozen=True, slots=True)
class WriteAgent(EngineOp):
    """Make the agent's warm file current (an export reads it): the pending write's future, or None."""

    agent_id: str

    def apply(self, ops: "AgentOps") -> "Future[Any] | None":
        return ops.write_agent(self.agent_id)


@dataclass(frozen=True, slots=True)
class CheckImport(EngineOp):
    agent_id: str
    replace: bool

    def apply(self, ops: "AgentOps") -> None:
        return ops.check_import(self.agent_id, self.replace)


@dataclass(frozen=True, slots=True)
class AdoptAgent(EngineOp):
    """Index the warm file an import just wrote; the agent's id."""

    path: Path

    def apply(self, ops: "AgentOps") -> str:
        return ops.adopt_agent(self.path)
