"""Waiting for the CPU backend's background warm-ups (its compiled loops loading)."""

from __future__ import annotations

import threading


def wait_for_warm_ups() -> None:
    """Join every warm-up thread a CPU backend started. A warm-up holds the parallel gate for a moment
    (``parallel_gate.py``), and a kernel called then declines and leaves the work to MLX."""
    for thread in threading.enumerate():
        if thread.name.endswith("-warmup"):
            thread.join()
