"""Engine-thread operations that change engine state, named so they can be sent between ranks.

``Engine.call`` runs any function on the engine thread. A function that
changes what the engine holds (evict, pin, delete, fork, rewind, import) must
be an ``EngineOp``: under a sharded model rank 0 sends it to the other ranks,
which apply it at the same point (engine/distributed/lockstep.py). A plain
function runs on rank 0 alone and may only read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineOp:
    name: str
    args: tuple[Any, ...] = ()

    def __call__(self, engine: Any) -> Any:
        return getattr(engine, self.name)(*self.args)


def engine_op(name: str, *args: Any) -> EngineOp:
    """``engine_op("evict_agent", agent_id, Tier.WARM)``: a picklable ``engine.evict_agent(...)``."""
    return EngineOp(name, args)
