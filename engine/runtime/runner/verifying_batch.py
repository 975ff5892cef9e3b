"""What a speculative step reads and calls on the batch it runs in (runner/speculative_step.py).

The batch owns its speculative steps (batch.py builds them); this is the
side of the batch they see, so the step needs no import of the batch.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.runtime.runner.backends.protocol import Backend
from engine.runtime.runner.sequence import Sequence
from engine.runtime.runner.step_output import StepOutput


class VerifyingBatch(Protocol):
    model: Any  # mlx.nn.Module
    backend: Backend
    sequences: dict[int, Sequence]
    max_batch_size: int
    prefill_step_size: int

    def room(self, sequence: Sequence, n_tokens: int) -> bool:
        """Whether the room granted for this step lets ``sequence``'s cache hold ``n_tokens`` positions."""

    def has_room(self, sequence: Sequence, out: StepOutput) -> bool:
        """Room for the sequence's next token; else it is finished out of room and reported in ``out``."""

    def checkpoint_prompt_ends(self, rows: list[Sequence], out: StepOutput) -> None:
        """Checkpoint the rows whose prompt just ended, before a pass feeds their first reply token."""

    def remove(self, uid: int) -> Sequence | None:
        """Stop a sequence now."""
