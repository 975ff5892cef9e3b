"""What one batch step produced: prefill progress, tokens (with the rows they stop), rows that found no room,
and checkpoints taken (for the scheduler to pay for, or drop).

Plain data, apart from the batch that fills it: the speculative step adds to
the same StepOutput, and the scheduler reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.runner.sequence import Released, RowStop


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    uid: int
    done: int  # prompt tokens in the cache now (of this turn's new ones)
    total: int
    at_checkpoint: bool = False


@dataclass(frozen=True, slots=True)
class TokenOut:
    uid: int
    token: int
    stop: RowStop | None = None  # the row stops with this token (why the turn ends: scheduler/turn_end.py)
    # A reasoning model's token: the tokens whose routes it decided (sequence.Released). None: answer text.
    released: Released = None


@dataclass(slots=True)
class StepOutput:
    prefill: list[PrefillProgress] = field(default_factory=list)
    tokens: list[TokenOut] = field(default_factory=list)
    # Sequences that could not get room for their next token (finished, no token).
    out_of_room: list[int] = field(default_factory=list)
    # Sequences that took a checkpoint (of a window or recurrent layers) in the step, in order: the arrays
    # exist, the pool has not paid for them yet.
    checkpoints: list[int] = field(default_factory=list)
