"""One sequence in the batch: its resident cache, what is left to feed, and what it made."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence as Tokens

from engine.domain.images import PromptImage
from engine.domain.rotary_positions import ImagePositions
from engine.domain.reasoning import Channel, Route
from engine.domain.reasoning_tracker import ReasoningTracker
from engine.grammar.token_constraint import TokenConstraint
from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.runtime.runner.sampling import RowSampler
from engine.runtime.runner.speculation import Speculation
from engine.runtime.runner.token_masks import Allow, Only, RowMask, Without

# Tokens whose routes a choice decided (a reasoning model's): each with where its text goes. None: the one token,
# answer text (no reasoning format).
Released = tuple[tuple[int, Route], ...] | None


class RowStop(enum.Enum):
    """What the token a row just chose settles on its own, so the batch launches the row no further: facts of the
    row, not a turn's finish. Why the turn ends is decided in one place (scheduler/turn_end.py), which also weighs
    what the batch cannot see (a stop string in the text, a format cut short, the server's guards)."""

    END_TOKEN = "end_token"  # an end-of-sequence token (not text)
    FORMAT_WHOLE = "format_whole"  # the reply's output format (a schema, a forced call) is whole with it
    TOKEN_LIMIT = "token_limit"  # the turn's max_tokens-th token


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
    # Where the turn's checkpoint goes when not one token short of the prompt's end (GenerationRequest.reply_start):
    # the prefill stops there and checkpoints. 0: at the prompt's end.
    turn_checkpoint_at: int = 0
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
    # The prompt's images whose runs lie (partly) past the cached prefix: prefill embeds them (image_embeddings.py).
    images: tuple[PromptImage, ...] = ()
    # The rotary positions of the turn's tokens where a multi-axis model's images move them (Qwen-VL's M-RoPE);
    # None: each token's cache position.
    positions: ImagePositions | None = None
    # The agent whose turn this is (a draft model's cache is kept per agent between turns); None: none.
    owner: str | None = None
    # Drafting and its tally, while the batch speculates (None: it does not, or not for this sequence).
    speculation: Speculation | None = None
    # The token a speculative step chose after the drafts it kept: not in the cache yet. It is the next input, and
    # is reported once a pass has fed it (with ``held_stop`` when the row stops with it), so every token reported
    # is in the cache, as with pipelined steps.
    held_token: int | None = None
    held_stop: RowStop | None = None
    held_released: Released = None
    # The output format the reply must follow (structured outputs): which tokens may come next. None: any.
    constraint: TokenConstraint | None = None
    # A reasoning model's turn: the route of each token (reasoning, answer, a call), its budget, the markers it
    # forces (domain/reasoning_tracker.py). The constraint applies to the answer only. None: no reasoning format.
    reasoning: ReasoningTracker | None = None
    # Set by the scheduler (scheduler/priorities.py): the order prompts are prefilled in (lower first) and the
    # level (0 most urgent), and whether the agent is paused (its row neither prefills nor decodes; its cache
    # stays as it is).
    rank: float = 0.0
    level: int = 0
    paused: bool = False

    @property
    def prefill_total(self) -> int:
        return len(self.prompt) - 1

    @property
    def prefill_left(self) -> int:
        return self.prefill_total - self.prompt_fed

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def decide(self, token: int) -> "Decision":
        """Count ``token``, chosen as this sequence's next one, route it, and say whether the row stops with it
        (RowStop: an end-of-sequence token, a reply its output format says is whole, ``max_tokens``)."""
        self.generated += 1
        if token in self.stop_tokens:  # not text, nor markup: what a marker's first tokens held back is text
            return Decision(RowStop.END_TOKEN, tuple(self.reasoning.flush()) if self.reasoning is not None else None)
        released = tuple(self.reasoning.feed(token)) if self.reasoning is not None else None
        if self.constraint is not None:
            for t in _answer_tokens(token, released):
                self.constraint.consume(t)
            if self.constraint.complete:
                return Decision(RowStop.FORMAT_WHOLE, released)
            if self.reasoning is None or self.reasoning.answering:
                self.constraint.near_limit(self.max_tokens - self.generated)
        if self.generated >= self.max_tokens:
            return Decision(RowStop.TOKEN_LIMIT, released)  # max_tokens
        return Decision(None, released)

    def mask(self) -> RowMask | None:
        """What the next token may be, when something rules it: the reasoning (a budget's forced marker) or the
        output format (in the answer). None: any token."""
        rule = self.reasoning.rule() if self.reasoning is not None else None
        if rule is not None and rule.force is not None:
            return Only(rule.force)
        if self.constraint is not None and (self.reasoning is None or self.reasoning.answering):
            words = self.constraint.allowed()
            opening = self.reasoning.opening_token if self.reasoning is not None else None
            return Allow(words, (opening,) if opening is not None else ())
        if rule is not None and rule.forbid:
            return Without(rule.forbid)
        return None

    def may_mask(self) -> bool:
        """Whether ``mask`` may rule the token after the one in flight: the batch then samples this row once that
        token is read (a constrained row always; a reasoning one near or past its budget)."""
        return self.constraint is not None or (self.reasoning is not None and self.reasoning.may_rule(1))


@dataclass(frozen=True, slots=True)
class Decision:
    stop: RowStop | None
    released: Released = None


def _answer_tokens(token: int, released: Released) -> list[int]:
    """The tokens a choice made answer text: what an output grammar reads."""
    if released is None:
        return [token]
    return [t for t, route in released if route.channel is Channel.ANSWER]
