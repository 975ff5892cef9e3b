"""One turn's constraint: which tokens may come next, as the turn's tokens are chosen."""

from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np

log = logging.getLogger(__name__)


class TokenConstraint:
    """Wraps one turn's llguidance matcher: feed it every token chosen, ask it what may follow.

    ``stop_tokens``: the model's end-of-sequence ids. The matcher allows them
    once the JSON is complete; they are also the way out should the matcher
    ever allow nothing (it then logs why), so a turn never samples from an
    all-masked row.
    """

    def __init__(self, matcher: Any, stop_tokens: Iterable[int]) -> None:
        self._matcher = matcher
        self._stop_tokens = tuple(stop_tokens)
        self.failed: str | None = None  # why the matcher refused a token (it should never: the mask forbids it)

    def consume(self, token: int) -> None:
        if self.failed is None and not self._matcher.consume_token(token):
            self.failed = self._matcher.get_error() or f"token {token} was not allowed"
            log.warning("constrained turn: the grammar refused token %d: %s", token, self.failed)

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
        return words
