"""One sequence in the batch: its resident cache, what is left to feed, and what it made."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.runtime.runner.sampling import RowSampler


class Phase(enum.Enum):
    PREFILL = "prefill"  # feeding the prompt in chunks (all but its last token)
    DECODE = "decode"  # one token per step
    DONE = "done"


@dataclass(eq=False, slots=True)
class Sequence:
    uid: int
    kv: SequenceKV
    # The prompt tokens not yet in the cache; the last one is the first decode input.
    prompt: list[int]
    max_tokens: int
    sampler: RowSampler | None = None  # None: greedy
    stop_tokens: frozenset[int] = frozenset()
    # Absolute positions at which to checkpoint the window layers while prefilling
    # (prefix boundaries other agents may share), and whether to keep one at the prompt end
    # (before its last token, the first decode input).
    checkpoint_at: tuple[int, ...] = ()
    checkpoint_prompt_end: bool = True
    phase: Phase = Phase.PREFILL
    prompt_fed: int = 0
    generated: int = 0
    # Every token that went into the cache during this turn, in order.
    fed: list[int] = field(default_factory=list)
    # The next decode input when it is known as a Python int (the first one: the prompt's last token).
    next_input: int | None = None
    # Set while the next decode input is the prompt's last token: that step completes the prompt.
    at_prompt_end: bool = False

    @property
    def prefill_total(self) -> int:
        return len(self.prompt) - 1

    @property
    def prefill_left(self) -> int:
        return self.prefill_total - self.prompt_fed

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE
