"""Noticing a generation that has fallen into a loop.

Small models decoding greedily (and sometimes sampling) can repeat one
sentence until ``max_tokens``: minutes of CPU for nothing, and clients such as
Claude Code ask for 32,000 tokens. A turn ends when its last ``window``
tokens are one cycle of at most ``MAX_PERIOD`` tokens repeated (at least three
times), i.e. when for some period p every one of those tokens equals the
token p before it.

Per token the guard updates, for every period p, how many tokens in a row
have matched the token p back: O(MAX_PERIOD) integer work, no lists rescanned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PERIOD = 64


@dataclass(frozen=True, slots=True)
class Loop:
    period: int  # tokens in one cycle
    span: int  # tokens of the response that are repetitions of it

    def describe(self) -> str:
        return f"a cycle of {self.period} token{'s' if self.period > 1 else ''} repeated for {self.span} tokens"


@dataclass(slots=True)
class RepetitionGuard:
    window: int  # 0: off
    _tokens: list[int] = field(default_factory=list)
    _runs: list[int] = field(default_factory=lambda: [0] * (MAX_PERIOD + 1))

    def push(self, token: int) -> Loop | None:
        """Add a generated token; a Loop when the response has just become a runaway repetition."""
        if self.window <= 0:
            return None
        tokens, runs = self._tokens, self._runs
        tokens.append(token)
        n = len(tokens)
        found: Loop | None = None
        for period in range(1, min(MAX_PERIOD, n - 1) + 1):
            runs[period] = runs[period] + 1 if tokens[n - 1 - period] == token else 0
            # The window is the cycle once, then runs[period] tokens each equal to the one a cycle back;
            # and the cycle must show at least three times, or one long "cycle" would fill any window.
            if found is None and runs[period] >= max(self.window - period, 2 * period):
                found = Loop(period, runs[period] + period)
        return found
