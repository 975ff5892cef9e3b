"""Noticing a generation that has fallen into a loop.

Small models (greedy or sampled) can repeat one sentence until
``max_tokens``: minutes of CPU for nothing, and clients such as Claude Code
ask for 32,000 tokens. Two shapes of loop end a turn, both measured against a
cycle of at most ``MAX_PERIOD`` tokens:

- an exact loop: the last ``window // 2`` tokens are one cycle repeated (at
  least three times), i.e. every one of them equals the token a cycle back;
- a near loop: of the last ``window`` tokens, at least ``SIMILARITY`` equal
  the token a cycle back. This is the loop a sampled small model really
  writes: a numbered list whose line repeats while its counter moves on
  (``# 7.3\\nThis is a minor detail to the above question.\\n\\n# 7.4\\n...``),
  which no exact cycle matches.

Why these numbers (``python -m bench.bench_runaway`` on the 2-core CPU box):
SmolLM2 answering Claude Code's recorded ``--continue`` request writes such a
list in most sampled answers (19 of 19 at its model card's temperature 0.2,
11 of 19 at 0.7); the near rule ended every one after 527-1,039 tokens (0.2)
or 610-1,499 (0.7), where without it they ran to the 4,096-token output cap.
Over 782 real source and documentation files (this repository, mlx-lm,
Textual, Rich, httpx, FastAPI, pydantic) it ended none: the highest share of
tokens equal to the token a cycle back in any 512-token window is 0.861 (a
table of spinner frames). Two looser rules were measured and rejected: an
n-gram novelty rule (ordinary code repeats more 8-grams, up to 0.88 of a
window, than the runaway lists, 0.57-0.78) and matching a token a cycle or a
cycle plus one back (it ends runaways sooner but scores three legitimate
tables above 0.9).

Cycles up to 128 tokens, not 64: Gemma 3 270M answering Codex CLI's ~6K-token
prompt looped over five XML-like lines of 65 tokens until the output cap (178 s on the 2-core CPU,
and Codex reports a reply cut at the cap as a failed turn). At 128 the guard still ends none of
the corpus's files (847 read).

Per token the guard's work is proportional to the new token's earlier
occurrences among the last MAX_PERIOD tokens (RepetitionGuard), nothing rescanned.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_PERIOD = 128
SIMILARITY = 0.9  # share of a window's tokens equal to the token a cycle back that makes a near loop


@dataclass(frozen=True, slots=True)
class Loop:
    period: int  # tokens in one cycle
    span: int  # tokens of the response that repeat it
    exact: bool = True

    def describe(self) -> str:
        cycle = f"a cycle of {self.period} token{'s' if self.period > 1 else ''}"
        if self.exact:
            return f"{cycle} repeated for {self.span} tokens"
        return f"{cycle} repeated with small changes (≥{SIMILARITY:.0%} of the last {self.span} tokens)"


@dataclass(slots=True)
class RepetitionGuard:
    """Per token the guard updates, for every period p, the run of tokens equal to the one p back and how
    many of the window's tokens are, and checks both rules. Only the periods at which the new token
    equals an earlier one (its occurrences among the last MAX_PERIOD tokens: few, in text that is not
    looping) change; every other run is broken, kept lazily as a stale run. So a token costs a few
    operations per earlier occurrence, not one per period: 3.5 us a token of code against 12 us for a
    loop over 64 periods and 25 us over 128 (the 2-core CPU box), on
    every sequence's every token; one token repeated costs ~30 us, and is ended within half a window.
    A period can newly meet a rule only where
    its run or count grew, or when the window first reaches it (``n == window + p``): those are checked.
    """

    window: int  # 0: off
    near: bool = True  # False: exact loops only (what a constrained reply's own guard watches for)
    _tokens: list[int] = field(default_factory=list)
    # token -> its positions among the last MAX_PERIOD tokens (oldest first)
    _seen: dict[int, deque[int]] = field(default_factory=dict)
    # per position: the periods p at which its token equals the one p back (what leaves the window later)
    _matched: list[tuple[int, ...]] = field(default_factory=list)
    _runs: list[int] = field(default_factory=lambda: [0] * (MAX_PERIOD + 1))
    _run_ends: list[int] = field(default_factory=lambda: [-2] * (MAX_PERIOD + 1))
    _matches: list[int] = field(default_factory=lambda: [0] * (MAX_PERIOD + 1))

    def push(self, token: int) -> Loop | None:
        """Add a generated token; a Loop when the response has just become a runaway repetition."""
        if self.window <= 0:
            return None
        i = len(self._tokens)  # this token's position
        self._tokens.append(token)
        n = i + 1
        positions = self._seen.setdefault(token, deque())
        while positions and i - positions[0] > MAX_PERIOD:
            positions.popleft()
        periods = tuple(i - q for q in reversed(positions))  # ascending
        positions.append(i)
        self._matched.append(periods)
        runs, ends, matches = self._runs, self._run_ends, self._matches
        for p in periods:
            runs[p] = runs[p] + 1 if ends[p] == i - 1 else 1
            ends[p] = i
            matches[p] += 1
        window, exact_window = self.window, max(self.window // 2, 2)
        leaving = n - 1 - window  # the token whose match bit just left the near window
        if leaving >= 1:
            for p in self._matched[leaving]:
                matches[p] -= 1
        need = SIMILARITY * window
        reaching = n - window  # the period the near window reaches with this token
        for p in sorted({*periods, reaching}) if 1 <= reaching <= min(MAX_PERIOD, i) else periods:
            # The exact window is the cycle once, then runs[p] tokens each equal to the one a cycle back;
            # and the cycle must show at least three times, or one long "cycle" would fill any window.
            if ends[p] == i and runs[p] >= max(exact_window - p, 2 * p):
                return Loop(p, runs[p] + p)
            if self.near and n >= window + p and matches[p] >= need:
                return Loop(p, window, exact=False)
        return None
