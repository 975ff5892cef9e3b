"""Turns on the device for the engines of several resident models.

Each resident model has its engine (its thread, pool, batch and agents); the
device is one. Two models computing at once would split it (on the CPU two
batches fight over the same cores and their BLAS and numba threads; on Metal
two command streams interleave) and neither would get a steady step time.
So an engine holds a turn while it admits and steps, and turns are handed out
first come, first served: while two models have work their steps alternate,
one each, and a small model decoding waits at most one step of a large
model's (a prefill chunk, ``prefill_step_size`` tokens) between two of its own.

An engine alone (one model served) takes its turn without waiting: the lock
is free, and a turn costs a lock round trip per step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator


class DeviceTurns:
    """A first-come, first-served lock (tickets), with what each holder waited, for the stats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._next_ticket = 0
        self._serving = 0
        self.waited_s: dict[str, float] = {}  # per engine label: seconds spent waiting for a turn
        self.turns: dict[str, int] = {}

    @contextlib.contextmanager
    def turn(self, holder: str) -> Iterator[None]:
        start = time.monotonic()
        with self._lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            while self._serving != ticket:
                self._changed.wait()
        waited = time.monotonic() - start
        self.waited_s[holder] = self.waited_s.get(holder, 0.0) + waited
        self.turns[holder] = self.turns.get(holder, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._serving += 1
                self._changed.notify_all()
