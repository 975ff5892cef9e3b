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
from typing import Protocol, Sequence

from engine.domain.images import is_image_token

# Tokens that must match before a continuation is proposed (two give too many false starts in code:
# every ``) {`` or ``", "`` would propose).
NGRAM = 3
# Latest places kept per n-gram, and how far back a candidate's match is compared.
PLACES_KEPT = 4
MATCH_LOOK_BACK = 32
# A sequence's expected share of kept drafts before it has any, and the weight of each verification after.
ACCEPTANCE_PRIOR = 0.6
ACCEPTANCE_SMOOTHING = 0.3


class Drafter(Protocol):
    """What proposes a sequence's drafts: this module's lookup, or a draft model (``model_drafting``)."""

    def extend(self, tokens: Sequence[int]) -> None: ...
    def has_draft(self) -> bool: ...
    def propose(self, k: int) -> list[int]: ...


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

    def has_draft(self) -> bool:
        """Whether the history's end continues something seen before (a proposal would have tokens)."""
        return bool(self.propose(1))

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
        draft = tokens[best:min(best + k, end)]
        # An image's tokens are never drafted: they are not the model's to write (domain/images.py).
        cut = next((i for i, token in enumerate(draft) if is_image_token(token)), len(draft))
        return draft[:cut]


class DraftLength:
    """How many tokens a sequence drafts next, from what its recent drafts got accepted."""

    def __init__(self, most: int, start: int = 4) -> None:
        self.most = most
        self.k = min(start, most)
        # Moving average of the share of drafted tokens kept: the chance the next draft is kept (allocate_drafts).
        self.acceptance = ACCEPTANCE_PRIOR
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
        self.acceptance += ACCEPTANCE_SMOOTHING * (accepted / drafted - self.acceptance)
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


def allocate_drafts(offers: list[tuple[int, float]], row_cost: float, rows: int, draft_cost: float = 0.0,
                    token_cost: float | None = None) -> list[int]:
    """How many of its offered drafts each sequence verifies this step, for the most tokens per second.

    ``offers``: per drafting sequence, the drafts it has and the chance each is kept (its recent acceptance;
    the j-th draft is kept with about that chance to the j-th power: only if every draft before it was);
    ``rows``: the step's sequences (each computes one token anyway); ``row_cost``: what one more token in the
    pass costs, as a share of a pass of one token (the backend's ``draft_row_cost``: about nothing where a
    pass reads weights it has arithmetic to spare for, a quarter on this project's 2-core CPU).

    A pass of R tokens takes about ``1 + row_cost * R`` and the step emits the expected tokens E; one more
    draft adds ``p`` expected tokens (its chance of being kept) and ``row_cost`` time, which raises E / time
    only while ``p / row_cost > E / time``. Chances fall with each further draft of a sequence, so taking
    the likeliest remaining draft while that holds finds the best allocation: many drafts for one agent
    copying a file, few each when eight share the pass, none for prose.

    ``token_cost``: what one more drafted token costs in the pass where it differs from a sequence's own token
    (the backend's ``draft_token_cost``: on the CPU's host path a sequence's drafts attend together, for a
    fraction of what its own row costs); None: ``row_cost``.

    ``draft_cost``: what making one draft costs, in the same unit (0 for a lookup; a draft model's decode step,
    about its weights' share of the served model's, since both steps read all their weights): a draft then
    adds ``row_cost + draft_cost``, so a draft model as large as the served one never pays.
    """
    taken = [0] * len(offers)
    per_draft = (row_cost if token_cost is None else token_cost) + draft_cost
    if per_draft <= 0:
        return [n for n, _ in offers]
    expected, time = float(rows), 1.0 + row_cost * rows
    while True:
        best, chance = -1, 0.0
        for i, (n, acceptance) in enumerate(offers):
            if taken[i] < n:
                p = acceptance ** (taken[i] + 1)
                if p > chance:
                    best, chance = i, p
        if best < 0 or chance * time <= per_draft * expected:
            return taken
        taken[best] += 1
        expected += chance
        time += per_draft
