"""The engine's clock for decisions: real monotonic time, or the tick time all ranks share.

Decisions that read the time (a queued turn timing out, a retained agent's
protection running out) must come out the same on every rank of a sharded
model, so under lockstep they read rank 0's time of the current tick instead
of each host's own clock (engine/distributed/lockstep.py). Measurements
(TTFT, hand-off seconds) keep reading ``time.monotonic`` directly.
"""

from __future__ import annotations

import threading
import time

_local = threading.local()


def now() -> float:
    """Monotonic seconds for a decision: this thread's tick time when one is set."""
    frozen = getattr(_local, "tick", None)
    return time.monotonic() if frozen is None else frozen


def set_tick(value: float | None) -> None:
    """Engine thread: decisions read ``value`` until the next call (None: the real clock)."""
    _local.tick = value

