"""Engine-thread operations that change engine state, as data, so they can be sent between ranks.

``Engine.call`` runs any function on the engine thread. A function that
changes what the engine holds (evict, pin, delete, fork, rewind, import) must
be an ``EngineOp``: under a sharded model rank 0 sends it to the other ranks,
which apply it at the same point (engine/distributed/lockstep.py). A plain
function runs on rank 0 alone and may only read. An op names one of the
commands of ``agent_ops.AGENT_OPS`` and is applied to the engine's
``AgentOps``: the engine's own methods are not a wire protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.runtime.engine_thread.agent_ops import AGENT_OPS


@dataclass(frozen=True, slots=True)
class EngineOp:
    name: str
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in AGENT_OPS:
            raise ValueError(f"{self.name!r} is no engine op (one of {', '.join(sorted(AGENT_OPS))})")

    def __call__(self, engine: Any) -> Any:
        return getattr(engine.ops, self.name)(*self.args)


def engine_op(name: str, *args: Any) -> EngineOp:
    """``engine_op("evict_agent", agent_id, Tier.WARM)``: a picklable ``engine.ops.evict_agent(...)``."""
    return EngineOp(name, args)
