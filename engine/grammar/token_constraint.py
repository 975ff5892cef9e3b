"""One turn's constraint: which tokens may come next, as the turn's tokens are chosen, and the reply steered
closed once it loops."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Literal

import numpy as np

from engine.domain.repetition import RepetitionGuard
from engine.domain.requests import LoopClosed
from engine.grammar.json_shape import JsonShape
from engine.grammar.loop_closing import ClosingTokens

log = logging.getLogger(__name__)

# The constrained reply's own exact-loop guard: a cycle repeated over half this many tokens. Tighter than the
# server's (``repetition_window``, 512) so that a string repeating itself is closed well before a typical
# ``max_tokens``; exact loops only (a near loop at this window fires on ordinary code, and strict tool
# calls carry code in their strings). Measured over 1,191 source and documentation files of the repository and
# its packages written as JSON strings (python -m bench.loop_false_positives, the 2-core CPU box):
# at this window it fires on none; at 64 tokens on 10, at 96 on 5 (tables, regular expressions, repeated
# arguments).
EXACT_WINDOW = 128
# The tokens a reply is left to close in before max_tokens, past one per open bracket or string (each closes in
# a token, or several in one): a required property still to come needs its name and an empty value. A reply
# that runs this close to max_tokens unclosed (a loop with varying items, which no guard matches, or an
# answer that is simply long) is steered closed rather than cut: sampled SmolLM2 and Gemma 3 replies to open
# schemas ran to their cap 2 and 7 times in 50 without it, none with it (bench_structured_outputs, the 2-core
# CPU box).
CLOSE_MARGIN = 16


class TokenConstraint:
    """Wraps one turn's llguidance matcher: feed it every token chosen, ask it what may follow.

    ``stop_tokens``: the model's end-of-sequence ids. The matcher allows them
    once the JSON is complete; they are also the way out should the matcher
    ever allow nothing (it then logs why), so a turn never samples from an
    all-masked row.

    ``closing``: the tokenizer's closing classes, when loops are closed (the
    ``close_constrained_loops`` setting). The reply's JSON shape and an exact
    loop guard then read every token; when either finds a loop (or the
    server's own guard does: :meth:`close`) before the value is whole, or
    the turn's sequence says max_tokens is near (:meth:`near_limit`), the
    mask from then on prefers the tokens that end it soonest.
    """

    def __init__(self, matcher: Any, stop_tokens: Iterable[int], closing: ClosingTokens | None = None) -> None:
        self._matcher = matcher
        self._stop_tokens = tuple(stop_tokens)
        self.failed: str | None = None  # why the matcher refused a token (it should never: the mask forbids it)
        self._closing = closing
        self._shape = JsonShape() if closing is not None else None
        self._guard = RepetitionGuard(EXACT_WINDOW, near=False) if closing is not None else None
        self.consumed = 0  # answer tokens read
        self.closed: LoopClosed | None = None  # set once a loop was noticed and the reply is being steered closed

    def consume(self, token: int) -> None:
        self.consumed += 1
        if self.failed is None and not self._matcher.consume_token(token):
            self.failed = self._matcher.get_error() or f"token {token} was not allowed"
            log.warning("constrained turn: the grammar refused token %d: %s", token, self.failed)
        if self._closing is None:
            return
        assert self._shape is not None and self._guard is not None
        # (read on while the reply closes: whether it is inside a string decides what closes it)
        repeated = self._shape.feed(self._closing.token_bytes[token] if token < len(self._closing.token_bytes)
                                    else b"")
        if self.closed is not None:
            return
        loop = self._guard.push(token)
        if repeated is not None:
            self.close(repeated.describe())
        elif loop is not None:
            self.close(loop.describe())

    def close(self, why: str, kind: Literal["loop", "token_limit"] = "loop") -> bool:
        """Steer the rest of the reply to its shortest valid end (a loop was found in it). False when loops are not
        closed (the setting), the reply is already whole, or it is already being closed."""
        if self._closing is None or self.closed is not None or self.complete or self.accepting:
            return False
        self.closed = LoopClosed(self.consumed, why, kind=kind)
        return True

    def near_limit(self, tokens_left: int) -> bool:
        """Steer the reply closed if ``tokens_left`` (of max_tokens) is about what its shortest end needs; whether
        it now is being closed for that."""
        if self._shape is None or self.closed is not None:
            return False
        if tokens_left > CLOSE_MARGIN + self._shape.depth + int(self._shape.in_string):
            return False
        return self.close(f"{tokens_left} tokens were left", kind="token_limit")

    @property
    def complete(self) -> bool:
        """The reply is complete: nothing but the end of the sequence can follow."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """What was chosen so far is a whole value of the format (the reply may end here)."""
        return self._matcher.is_accepting()

    def allowed(self) -> np.ndarray:
        """The tokens that may come next: a bitmask, token ``t`` at bit ``t % 32`` of 32-bit word ``t // 32``."""
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32).copy()
        if self.failed is not None or not words.any():
            words[:] = 0
            for token in self._stop_tokens:
                if token // 32 < len(words):
                    words[token // 32] |= np.uint32(1 << (token % 32))
        elif self.closed is not None:
            assert self._closing is not None and self._shape is not None
            words = self._closing.prefer(words, self._shape.in_string)
        return words
