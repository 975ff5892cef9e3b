"""What the scheduler calls on the batch it steps: the model runner's side of plan, grant, run, apply.

``batch.py``'s :class:`SequenceBatch` implements it; the scheduler names
only this, so a test may wrap the batch (a step that fails or hangs) and the
scheduler's uses of it are all here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.runtime.runner.image_embeddings import ImageEmbedder
from engine.runtime.runner.sequence import Sequence
from engine.runtime.runner.step_output import StepOutput
from engine.runtime.runner.step_plan import Room, StepPlan


@runtime_checkable
class SteppedBatch(Protocol):
    # Prompt tokens one step may prefill at most (the scheduler sets it before each plan: prefill_pacer.py).
    prefill_step_size: int
    # A vision model's image embedder (its meters are shown); None for a text model.
    images: ImageEmbedder | None

    @property
    def decoding(self) -> int:
        """How many rows decode (not paused) now."""
        ...

    def insert(self, sequence: Sequence) -> None:
        """Add an admitted turn's sequence: it prefills its prompt, then decodes."""
        ...

    def remove(self, uid: int) -> Sequence | None:
        """Stop a sequence now; its cache keeps what was fed."""
        ...

    def plan(self) -> StepPlan:
        """What the next step will do, and the room each cache needs for it."""
        ...

    def step(self, plan: StepPlan, room: Room) -> StepOutput:
        """Run ``plan``'s model work within ``room`` (what the scheduler granted)."""
        ...
