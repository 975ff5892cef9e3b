"""Turns on the device for the engines of several resident models: each gets an equal share of its time.

Each resident model has its engine (its thread, pool, batch and agents); the
device is one. Two models computing at once would split it (on the CPU two
batches fight over the same cores and their BLAS and numba threads; on Metal
two command streams interleave) and neither would get a steady step time.
So an engine holds a turn while it admits and steps.

Turns go by device time, not by steps: of the engines waiting, the one that
has held the device least goes next (a virtual clock per engine, as a
fair-share CPU scheduler keeps one per task). A step of a large model's
prefill (a chunk of ``prefill_step_size`` tokens) can take a second on a
CPU where a small model's decode step takes 30 ms; by steps, the small model
would get one token a second while the other prefills; by time, it decodes
until it has had as much of the device as the chunk took, so while both have
work each gets half the device (bench/bench_resident_models.py measures it).
An engine that just ended its turn is still counted among those waiting for
``RETURN_S``: between two steps it spends a moment outside the lock (its
loop's bookkeeping), and a waiting engine must not take the device in that
gap if the engine that just stepped has used less of it. An engine that was
idle comes back at the present (its clock moves up to the
clock of the last turn handed out): idle time is not saved up as credit.

By time alone, a model that decodes while another prefills still waits a
whole prefill chunk between two of its tokens (1.2 s for Gemma 3 270M's 512
tokens on a 2-core CPU). So while another engine waits, an engine prefills
at most ``CONTENDED_PREFILL_TOKENS`` a step (``contended``): the same share
of the device, in slices short enough to keep the other model's tokens coming.

An engine alone (one model served) takes its turn without waiting: the lock
is free, and a turn costs a lock round trip per step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

# How long an engine that just stepped still counts as waiting for its next turn (its loop between two steps
# takes well under a millisecond to a few; a waiter then waits at most this much longer when it goes idle).
RETURN_S = 0.01
# A step's prefill while another engine waits for the device.
CONTENDED_PREFILL_TOKENS = 128


class DeviceTurns:
    """A lock handed, among those waiting, to the holder that has used the device least."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._holder: str | None = None
        self._waiting: dict[str, float] = {}  # holder -> when it asked (ties go to the earlier)
        self._used: dict[str, float] = {}  # holder -> its virtual clock: seconds it has held the device
        self._clock = 0.0  # the virtual clock of the last turn handed out
        self._returning: dict[str, float] = {}  # holder -> when its last turn ended
        self.waited_s: dict[str, float] = {}  # per engine label: seconds spent waiting for a turn
        self.held_s: dict[str, float] = {}
        self.turns: dict[str, int] = {}

    @contextlib.contextmanager
    def turn(self, holder: str) -> Iterator[None]:
        asked = time.monotonic()
        with self._changed:
            self._used[holder] = max(self._used.get(holder, 0.0), self._clock)
            self._waiting[holder] = asked
            self._returning.pop(holder, None)
            while True:
                wait_s = self._wait_for(holder)
                if wait_s == 0.0:
                    break
                self._changed.wait(wait_s)
            del self._waiting[holder]
            self._holder = holder
            self._clock = self._used[holder]
        began = time.monotonic()
        self.waited_s[holder] = self.waited_s.get(holder, 0.0) + began - asked
        self.turns[holder] = self.turns.get(holder, 0) + 1
        try:
            yield
        finally:
            held = time.monotonic() - began
            self.held_s[holder] = self.held_s.get(holder, 0.0) + held
            with self._changed:
                self._used[holder] += held
                self._holder = None
                self._returning[holder] = time.monotonic()
                self._changed.notify_all()

    def contended(self, holder: str) -> bool:
        """Whether another engine waits for the device, or has just stepped and will again."""
        now = time.monotonic()
        with self._changed:
            return any(h != holder for h in self._waiting) or any(
                h != holder and now - t < RETURN_S for h, t in self._returning.items())

    def _wait_for(self, holder: str) -> float | None:
        """0.0: ``holder`` goes now; else how long to wait before looking again (None: until notified)."""
        if self._holder is not None:
            return None
        now = time.monotonic()
        returning = {h: t for h, t in self._returning.items() if now - t < RETURN_S}
        self._returning = returning
        contenders = {**self._waiting, **returning}
        first = min(contenders, key=lambda h: (self._used[h], contenders[h]))
        if first == holder:
            return 0.0
        if first in returning:  # it may step again at once; if it does not, this one goes
            return RETURN_S - (now - returning[first])
        return None
