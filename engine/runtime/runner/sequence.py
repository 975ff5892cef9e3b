"""One sequence in the batch: its resident cache, what is left to feed, and what it made."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence as Tokens

from engine.domain.requests import FinishReason
from engine.grammar.token_constraint import TokenConstraint
from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.runtime.runner.sampling import RowSampler
from engine.runtime.runner.speculation import Speculation


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
    # The tokens the cache held before this turn's prompt (the agent's history: what drafts are looked up in).
    context: Tokens[int] = ()
    # The agent whose turn this is (a draft model's cache is kept per agent between turns); None: none.
    owner: str | None = None
    # Drafting and its tally, while the batch speculates (None: it does not, or not for this sequence).
    speculation: Speculation | None = None
    # The token a speculative step chose after the drafts it kept: not in the cache yet. It is the next input, and
    # is reported once a pass has fed it (with ``held_finish`` when it ends the sequence), so every token reported
    # is in the cache, as with pipelined steps.
    held_token: int | None = None
    held_finish: FinishReason | None = None
    # The output format the reply must follow (structured outputs): which tokens may come next. None: any.
    constraint: TokenConstraint | None = None

    @property
    def prefill_total(self) -> int:
        return len(self.prompt) - 1

    @property
    def prefill_left(self) -> int:
        return self.prefill_total - self.prompt_fed

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def decide(self, token: int) -> FinishReason | None:
        """Count ``token``, chosen as this sequence's next one, and say why the sequence ends with it, if it does:
        an end-of-sequence token, a reply its output format says is complete, or ``max_tokens``."""
        self.generated += 1
        if token in self.stop_tokens:
            return FinishReason.STOP
        if self.constraint is not None:
            self.constraint.consume(token)
            if self.constraint.complete:
                return FinishReason.STOP
        if self.generated >= self.max_tokens:
            return FinishReason.LENGTH  # max_tokens
        return None
