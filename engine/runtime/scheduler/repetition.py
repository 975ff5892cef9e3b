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

Why these numbers (bench/bench_runaway.py; report bench/reports/2026-11-27-cpu-2core):
SmolLM2 answering Claude Code's recorded ``--continue`` request writes such a
list in most sampled answers (19 of 19 at its model card's temperature 0.2,
11 of 19 at 0.7); the near rule ended every one after 527-1,039 tokens (0.2)
or 610-1,499 (0.7), where before they ran to the 4,096-token output cap.
Over 782 real source and documentation files (this repository, mlx-lm,
Textual, Rich, httpx, FastAPI, pydantic) it ended none: the highest share of
tokens equal to the token a cycle back in any 512-token window is 0.861 (a
table of spinner frames). Two looser rules were measured and rejected: an
n-gram novelty rule (ordinary code repeats more 8-grams, up to 0.88 of a
window, than the runaway lists, 0.57-0.78) and matching a token a cycle or a
cycle plus one back (it ends runaways sooner but scores three legitimate
tables above 0.9).

Cycles up to 128 tokens, not 64 as first measured: Gemma 3 270M answering Codex CLI's ~6K-token
prompt looped over five XML-like lines of 65 tokens until the output cap (178 s on the 2-core CPU,
and Codex reports a reply cut at the cap as a failed turn). At 128 the guard still ends none of
the corpus's files (847 read, bench/reports/2026-11-29-cpu-2core-s15/runaway_false_positives.log).

Per token the guard updates, for every period p, the run of exact matches and
the count of matches in the window: O(MAX_PERIOD) integer work, nothing
rescanned.
"""

from __future__ import annotations

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
    window: int  # 0: off
    _tokens: list[int] = field(default_factory=list)
    _runs: list[int] = field(default_factory=lambda: [0] * (MAX_PERIOD + 1))
    _matches: list[int] = field(default_factory=lambda: [0] * (MAX_PERIOD + 1))

    def push(self, token: int) -> Loop | None:
        """Add a generated token; a Loop when the response has just become a runaway repetition."""
        if self.window <= 0:
            return None
        tokens, runs, matches = self._tokens, self._runs, self._matches
        tokens.append(token)
        n = len(tokens)
        window, exact_window = self.window, max(self.window // 2, 2)
        need = SIMILARITY * window
        leaving = n - 1 - window  # the token whose match bit just left the near window
        found: Loop | None = None
        for period in range(1, min(MAX_PERIOD, n - 1) + 1):
            same = tokens[n - 1 - period] == token
            runs[period] = runs[period] + 1 if same else 0
            matches[period] += same
            if leaving >= period:
                matches[period] -= tokens[leaving] == tokens[leaving - period]
            if found is not None:
                continue
            # The exact window is the cycle once, then runs[period] tokens each equal to the one a cycle back;
            # and the cycle must show at least three times, or one long "cycle" would fill any window.
            if runs[period] >= max(exact_window - period, 2 * period):
                found = Loop(period, runs[period] + period)
            elif n >= window + period and matches[period] >= need:
                found = Loop(period, window, exact=False)
        return found
