"""Throughput meters: tokens per second over a sliding time window."""

from __future__ import annotations

import time
from collections import deque


class RateMeter:
    """Counts events (tokens) and reports their rate over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 5.0) -> None:
        self._window = window_s
        self._marks: deque[tuple[float, int]] = deque()
        self._total = 0

    @property
    def total(self) -> int:
        return self._total

    def add(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        self._marks.append((now, n))
        self._total += n
        self._expire(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._expire(now)
        if not self._marks:
            return 0.0
        span = max(now - self._marks[0][0], 1e-3)
        # A burst younger than a second is measured against a full second so a
        # single step does not read as an enormous rate.
        return sum(n for _, n in self._marks) / max(span, min(self._window, 1.0))

    def count(self, now: float | None = None) -> int:
        """Events inside the window (per minute, for a 60 s window)."""
        self._expire(time.monotonic() if now is None else now)
        return sum(n for _, n in self._marks)

    def _expire(self, now: float) -> None:
        while self._marks and now - self._marks[0][0] > self._window:
            self._marks.popleft()


class RecentValues:
    """The last ``size`` observations of something (TTFTs, batch sizes)."""

    def __init__(self, size: int = 64) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(value)

    def values(self) -> tuple[float, ...]:
        return tuple(self._values)

    def mean(self) -> float | None:
        return sum(self._values) / len(self._values) if self._values else None

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0-1) of the values kept, nearest rank; None when there are none."""
        if not self._values:
            return None
        ordered = sorted(self._values)
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]

    def max(self) -> float | None:
        return max(self._values) if self._values else None
