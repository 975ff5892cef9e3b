"""A gated-delta hybrid's prefill recurrence on the CPU, through ``gated_delta_kernel`` instead of MLX steps.

The CPU backend puts :func:`steps` in place of mlx-lm's ``gated_delta_ops``
(``hooks.py``) inside its own forward pass. It takes a chunk of
``MIN_STEPS`` tokens or more with scalar gates and no padding mask (the
engine never pads a recurrent row); anything else (a decode step, Kimi's
per-channel gates, a padded batch) returns None and mlx-lm's steps run.

A decode step stays in MLX: one token's step is a few operations, and
leaving MLX's graph for it would cost an evaluation of everything before it.
A chunk pays that evaluation once and wins it back many times: measured on
the Qwen3.5-0.8B-shaped bench model (6 recurrent layers, 16 heads of
128x128), see the kernel's docstring and ``docs/performance.md``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.runtime.runner.backends.cpu.parallel_gate import PARALLEL

# Fewer tokens than this stay in mlx-lm's steps (a decode step, a speculative verify of a few tokens).
MIN_STEPS = 16


def long_enough(q: mx.array) -> bool:
    """A prefill chunk of ``MIN_STEPS`` tokens or more (q: (B, T, Hk, Dk))."""
    return q.ndim == 4 and q.shape[1] >= MIN_STEPS


def steps(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
          mask: mx.array | None = None) -> tuple[mx.array, mx.array] | None:
    """``gated_delta_ops``'s ``(y, state)`` for a prefill chunk; None where mlx-lm's steps should run."""
    if mask is not None or g.ndim != 3 or not long_enough(q):
        return None
    from engine.runtime.runner.backends.cpu import gated_delta_kernel  # (numba: only where the CPU prefills)

    arrays = [a.astype(mx.float32) for a in (q, k, v, g, beta, state)]
    mx.eval(arrays)
    q_, k_, v_, g_, beta_ = (np.ascontiguousarray(a) for a in arrays[:5])  # (views of MLX's buffers, read only)
    # The loop updates the state in place: a copy, since the array passed in may be a snapshot still held.
    state_ = np.array(arrays[5], dtype=np.float32, copy=True, order="C")
    y = np.empty(v_.shape, dtype=np.float32)
    if not PARALLEL.acquire(blocking=False):
        return None  # another thread is in a parallel loop (see parallel_gate.py): mlx-lm's steps
    try:
        gated_delta_kernel.recurrence(q_, k_, v_, g_, beta_, state_, y)
    finally:
        PARALLEL.release()
    return mx.array(y).astype(q.dtype), mx.array(state_)


def warm_up() -> None:
    """Load (the first time: compile) the loop; raises where it cannot load."""
    from engine.runtime.runner.backends.cpu.gated_delta_kernel import recurrence

    # Compiled (or loaded from numba's cache) outside the gate, which then holds only a tiny run.
    recurrence.compile("(" + ", ".join(["float32[:, :, :, ::1]"] * 3 + ["float32[:, :, ::1]"] * 2
                                       + ["float32[:, :, :, ::1]"] * 2) + ")")
    shape = (1, 2, 1, 4)
    with PARALLEL:
        recurrence(np.ones(shape, np.float32), np.ones(shape, np.float32), np.ones(shape, np.float32),
                   np.ones((1, 2, 1), np.float32), np.ones((1, 2, 1), np.float32),
                   np.zeros((1, 1, 4, 4), np.float32), np.empty(shape, np.float32))
