"""Drafts for speculative decoding, looked up in a sequence's own tokens (prompt lookup, n-gram drafting).

A coding agent's output copies its context: a file rewritten with one
change, an edit's old and new strings, a tool call quoting paths it just
read. Every sequence here holds its agent's whole history (the cached
prompt, this turn's new tokens, what it generated), so the next tokens can
be guessed by finding the latest tokens earlier in that history and
proposing what followed them there. The batch then verifies the guesses in
one forward pass (``speculation.py``); a wrong guess costs a little
arithmetic, never a wrong token.

:class:`LookupDrafter` indexes every ``NGRAM``-token run of the history by
where it ended (the latest few places for each), so a lookup is a dict
access and a short backward comparison, and each generated token costs one
index update. Among the places where the last ``NGRAM`` tokens occurred
before, it picks the one whose match reaches furthest back (the most
context in common), the latest on a tie.

:class:`DraftLength` sets how many tokens a sequence drafts from its recent
acceptance: longer while drafts are taken whole, back to what was taken
after a miss, and none for a while after several misses in a row (prose
that only looks like its context), so a sequence that gains nothing from
drafting pays for it only now and then.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

# Tokens that must match before a continuation is proposed (two give too many false starts in code:
# every ``) {`` or ``", "`` would propose).
NGRAM = 3
# Latest places kept per n-gram, and how far back a candidate's match is compared.
PLACES_KEPT = 4
MATCH_LOOK_BACK = 32


class LookupDrafter:
    """Drafts from one sequence's token history."""

    def __init__(self, history: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._places: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.extend(history)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens that came after the history (generated, or fed as the prompt)."""
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            if end >= NGRAM:
                places = self._places[tuple(self.tokens[end - NGRAM:end])]
                places.append(end)
                if len(places) > PLACES_KEPT + 1:  # (+1: the newest is the tail itself, never a candidate)
                    del places[0]

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the best earlier match of the history's end; [] for none."""
        tokens = self.tokens
        end = len(tokens)
        if k <= 0 or end < NGRAM + 1:
            return []
        places = self._places.get(tuple(tokens[end - NGRAM:end]))
        if not places:
            return []
        best, best_length = -1, 0
        for place in places:
            if place >= end:
                continue  # the history's own end
            length = NGRAM
            while (length < MATCH_LOOK_BACK and place - length - 1 >= 0
                   and tokens[place - length - 1] == tokens[end - length - 1]):
                length += 1
            if length >= best_length:  # (places are in order: on a tie the later wins)
                best, best_length = place, length
        if best < 0:
            return []
        return tokens[best:min(best + k, end)]


class DraftLength:
    """How many tokens a sequence drafts next, from what its recent drafts got accepted."""

    def __init__(self, most: int, start: int = 4) -> None:
        self.most = most
        self.k = min(start, most)
        self._misses = 0  # verifications in a row that took no draft
        self._pause = 0  # steps left without drafting
        self._backoff = 8

    def next(self) -> int:
        """The draft length for this step (0: not now)."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return self.k

    def taken(self, drafted: int, accepted: int) -> None:
        """A verification of ``drafted`` tokens kept ``accepted`` of them."""
        if drafted <= 0:
            return
        if accepted == drafted:
            self.k = min(self.most, self.k * 2)
        else:
            self.k = max(1, min(self.k, accepted + 1))
        if accepted == 0:
            self._misses += 1
            if self._misses >= 3:  # drafting does not pay here: stop for a while, longer each time
                self._pause, self._misses = self._backoff, 0
                self._backoff = min(self._backoff * 2, 256)
        else:
            self._misses = 0
            self._backoff = 8
