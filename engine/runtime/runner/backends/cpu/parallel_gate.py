"""One gate for the CPU backend's parallel compiled loops (numba ``parallel=True``).

Where OpenMP is missing numba runs them on its work-queue threading layer,
which is one per process and aborts the process when two threads enter it at
once. Two engines in one process (a swap, the tests), or two warm-ups, can
call two such loops together, so every caller passes this lock: a step's
caller that finds it taken runs MLX's path instead of waiting; a warm-up
waits.
"""

from __future__ import annotations

import threading

PARALLEL = threading.Lock()
