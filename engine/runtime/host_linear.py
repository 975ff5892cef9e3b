"""A decode step's linear layers on the CPU, through ``linear_kernel`` instead of BLAS's ``sgemm``.

At one to eight rows (agents decoding together) a linear layer is bound by
reading its weights, and MLX's CPU matmul (``sgemm``) reads them at about
half the rate the compiled pass in ``linear_kernel.py`` does. SmolLM2's
one-agent forward spent ~50 of its ~67 ms in linear layers.

:func:`install` gives the model's float32 ``nn.Linear`` layers (and a tied
output layer, ``nn.Embedding.as_linear``) a ``__call__`` that, inside the
engine's forward (``cpu_math.routing``) and for at most ``MAX_ROWS`` rows,
evaluates its input and runs the pass on the weights' own buffer (an
evaluated MLX array hands numpy its memory: nothing is copied). Everywhere
else (prefill chunks, 16-row batches where ``sgemm`` is as fast, other
dtypes, quantized layers, mlx-lm's own generation on the same model) MLX's
matmul runs as before. The price is one ``mx.eval`` where a layer's input
was not evaluated yet (four a decoder layer: attention's input, its output,
the MLP's input and its hidden state), which is why this stops at 8 rows.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.distributed.local_ranks import process_cores
from engine.runtime import cpu_math

log = logging.getLogger("semantic.engine")

# Above this many rows BLAS's sgemm is as fast (16 rows: 56 ms both over SmolLM2's weights).
MAX_ROWS = 8
# Turned off to compare (bench/bench_forward_split.py, bench_step_profile.py) and when the kernel cannot load.
enabled = True
# One caller at a time: numba's work-queue threading layer (where OpenMP is missing) must not be
# entered from two threads at once; a second caller takes MLX's matmul instead of waiting.
_busy = threading.Lock()


def _times_weights(x: mx.array, weights: mx.array) -> mx.array | None:
    """``x @ weights.T`` through the compiled pass, or None where MLX's matmul should run."""
    if not (enabled and cpu_math.routed() and x.dtype == mx.float32 and weights.dtype == mx.float32
            and weights.ndim == 2):
        return None
    inner = x.shape[-1]
    rows = x.size // inner if inner else 0
    if not 0 < rows <= MAX_ROWS:
        return None
    mx.eval(x, weights)
    out = times(np.asarray(x).reshape(rows, inner), np.asarray(weights))
    return None if out is None else mx.array(out.reshape(*x.shape[:-1], out.shape[-1]))


def times(x: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
    """``x @ weights.T`` for ``x`` (rows, inner) through the compiled pass; None where it does not run: more
    than ``MAX_ROWS`` rows, weights that are not one C-contiguous float32 buffer (a view of another array:
    BLAS reads it where it lies, a copy would cost more), the pass off, or another thread inside it."""
    if not (enabled and 0 < x.shape[0] <= MAX_ROWS and weights.dtype == np.float32 and weights.flags.c_contiguous):
        return None
    if not _busy.acquire(blocking=False):
        return None
    try:
        from engine.runtime import linear_kernel  # (numba: only where the CPU decodes)

        out = np.empty((x.shape[0], weights.shape[0]), dtype=np.float32)
        linear_kernel.times_transposed(np.ascontiguousarray(x, dtype=np.float32), weights, out, threads())
    finally:
        _busy.release()
    return out


_THREADS = min(8, process_cores())


def threads() -> int:
    """Threads the pass splits its outputs across (this process's cores, up to 8: ranks sharing a host
    split its cores)."""
    return _THREADS


class HostLinear(nn.Linear):
    """``nn.Linear`` whose few-row float32 products inside the engine's forward use ``linear_kernel``."""

    def __call__(self, x: mx.array) -> mx.array:
        out = _times_weights(x, self["weight"])
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out


class HostEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied output layer) does the same."""

    def as_linear(self, x: mx.array) -> mx.array:
        out = _times_weights(x, self.weight)
        return super().as_linear(x) if out is None else out


def install(model: Any) -> int:
    """Give the model's ``nn.Linear`` and ``nn.Embedding`` layers the classes above; returns how many.

    Only the exact classes are replaced (a subclass, such as a LoRA layer,
    keeps its own ``__call__``); parameters, names and saving are unchanged.
    """
    swapped = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = HostLinear
            swapped += 1
        elif type(module) is nn.Embedding:
            module.__class__ = HostEmbedding
            swapped += 1
    return swapped


def prepare() -> None:
    """Load (the first time: compile) the pass in the background, so the first decode step does not wait."""
    threading.Thread(target=_warm_up, name="semantic-linear-warmup", daemon=True).start()


def _warm_up() -> None:
    global enabled
    try:
        from engine.runtime.linear_kernel import times_transposed

        times_transposed(np.ones((2, 8), np.float32), np.ones((5, 8), np.float32), np.empty((2, 5), np.float32), 2)
    except Exception as exc:  # noqa: BLE001 (any failure to load or compile means: not here)
        enabled = False
        log.warning("decode's linear layers stay in MLX: the compiled pass did not load (%s: %s)",
                    type(exc).__name__, exc)
