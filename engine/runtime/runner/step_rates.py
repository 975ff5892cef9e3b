"""Whether speculative steps pay for the batch as it runs now: tokens a row gets per second, with and without.

A speculative step computes every drafted token: on a device with arithmetic
to spare (a GPU, Apple silicon at small batch) that is about free, so any
kept draft is a gain; on a CPU, or with many agents, the pass can cost more
than its kept drafts save. Each sequence already stops drafting where its
drafts are not kept (``drafting.DraftLength``); this watches the batch as a
whole. It keeps a moving average of the tokens a row gets per second over
plain (pipelined) steps and over speculative ones, on steady steps only (no
prefill in the step, and for a speculative step none in flight before it),
and when speculative steps fall behind plain ones the batch stops
speculating for a while, longer each time it is tried and does not pay.
"""

from __future__ import annotations

# Weight of the newest step in the moving averages.
SMOOTHING = 0.2
# Steps of each kind measured before the two are compared.
WARM_STEPS = 4
# Speculative steps must reach this share of the plain steps' rate.
FLOOR = 0.95
# Plain steps the batch waits before trying again, at first and at most.
FIRST_PAUSE, LONGEST_PAUSE = 32, 1024


class _Average:
    def __init__(self) -> None:
        self.value = 0.0
        self.count = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.count == 0 else (1 - SMOOTHING) * self.value + SMOOTHING * sample
        self.count += 1


class StepRates:
    def __init__(self) -> None:
        self.plain = _Average()
        self.speculative = _Average()
        self.paused_for = 0  # plain steps left before speculation may be tried again
        self._pause = FIRST_PAUSE
        self.pauses = 0  # times speculation was found not to pay (for the stats and tests)

    def allowed(self) -> bool:
        return self.paused_for == 0

    def plain_step(self, rows: int, seconds: float) -> None:
        """A steady pipelined step: one token for each of ``rows`` rows."""
        if self.paused_for > 0:
            self.paused_for -= 1
        if rows and seconds > 0:
            self.plain.add(1 / seconds)

    def speculative_step(self, rows: int, tokens: int, seconds: float) -> None:
        """A steady speculative step: ``tokens`` emitted over ``rows`` rows."""
        if not rows or seconds <= 0:
            return
        self.speculative.add(tokens / rows / seconds)
        if self.speculative.count >= WARM_STEPS and self.plain.count >= WARM_STEPS:
            if self.speculative.value < FLOOR * self.plain.value:
                self.paused_for, self._pause = self._pause, min(self._pause * 2, LONGEST_PAUSE)
                self.pauses += 1
                self.speculative = _Average()  # measured afresh next time
            else:
                self._pause = FIRST_PAUSE
