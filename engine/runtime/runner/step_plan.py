"""What the next batch step will do, worked out before it runs: its prefill passes and the room each
sequence's cache needs.

The engine step has three parts (scheduler/scheduler.py): the batch *plans*
(``SequenceBatch.plan``, no side effects), the scheduler *grants* room for
the plan (reserving pool blocks and growing arrays, evicting other agents
when it must: the only part that may touch the tiers or the disk), and the
batch *runs* the plan within the room granted (``SequenceBatch.step``), which
is model work only; the scheduler then applies the step's output to its
turns. The batch never calls back into the scheduler while it runs.

Each sequence asks for room in levels, the least first: a prefill chunk
needs its own positions; a row that will decode needs one more position; a
padded pass's filler and speculative drafts would like more. A grant is the
highest level the pool could give; what the step may not do within it, it
leaves out (filler: the row waits for a later pass; drafts: none this step),
and a sequence with no grant at all ends out of room, as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from engine.runtime.runner.sequence import Sequence


@dataclass(frozen=True, slots=True)
class RoomAsk:
    """The positions one sequence's cache may grow to in the coming step: ascending levels, each one worth
    granting only after the one before it (``levels[0]``: what it cannot go on without)."""

    sequence: Sequence
    levels: tuple[int, ...]

    @staticmethod
    def of(sequence: Sequence, needed: int, *more: int) -> "RoomAsk":
        return RoomAsk(sequence, tuple(sorted({needed, *(n for n in more if n > needed)})))


@dataclass(slots=True)
class StepPlan:
    # The prefill passes, in order: each a group of (sequence, its chunk), run as one pass.
    prefill: list[list[tuple[Sequence, int]]] = field(default_factory=list)
    asks: list[RoomAsk] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.asks


# What the scheduler granted: each sequence's cache may grow to this many positions (absent: none).
Room = Mapping[int, int]
