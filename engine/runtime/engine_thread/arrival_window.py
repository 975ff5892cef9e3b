"""How long an idle engine that just got work waits for more before its first step.

Requests of a burst (agents started together) arrive a few ms apart; prefilling them in one step instead
of one by one saves each later request a whole prefill of waiting. A lone request (one agent's turn, a
person's warm turn) gains nothing from the wait and its time to first token pays all of it. So the window
is waited only while arrivals have been clustering: the last time the engine woke, another request came
within the window. It starts that way (a server's first requests are often a burst); a wake with no
follower turns it off, and a request that follows a wake within the window turns it back on, so a burst
after lone requests loses one gathering (its later requests wait out the first one's step) and the next
burst is gathered again.
"""

from __future__ import annotations


class ArrivalWindow:
    """Whether arrivals have been clustering, from the wakes of an idle engine and the requests after them."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.clustering = True
        self._woke_at: float | None = None
        self._followers = 0

    def arrived(self, at: float) -> None:
        """A request was submitted at ``at`` (monotonic seconds), whether the engine was idle or not."""
        if self._woke_at is not None and 0 < at - self._woke_at <= self.window_s:
            self._followers += 1

    def woke(self, first_at: float, waiting: int) -> float:
        """The idle engine got work: ``waiting`` requests, the first submitted at ``first_at``. The seconds to
        wait for more before stepping."""
        followed = self._woke_at is None or self._followers > 0  # (the first wake counts as followed)
        self._woke_at, self._followers = first_at, waiting - 1
        self.clustering = followed or waiting > 1
        return self.window_s if self.clustering else 0.0
