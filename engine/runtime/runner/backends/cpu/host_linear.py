"""A decode step's linear layers on the CPU, through ``linear_kernel`` instead of BLAS's ``sgemm``.

At a few rows (agents decoding together) a linear layer is bound by reading
its weights, and MLX's CPU matmul (``sgemm``) reads them at a half to a third
of the rate the compiled pass in ``linear_kernel.py`` does (SmolLM2's weights
at 1 / 8 / 16 rows: 58 / 74 / 76 ms against 24 / 30 / 38 ms). SmolLM2's
one-agent forward spent ~50 of its ~67 ms in linear layers.

The CPU backend gives the model's float32 ``nn.Linear`` layers (and a tied
output layer, ``nn.Embedding.as_linear``) a class of its own
(:func:`layer_classes`): its ``__call__``, inside that backend's forward pass
and for at most ``MAX_ROWS`` rows, evaluates its input and runs the pass on
the weights' own buffer (an evaluated MLX array hands numpy its memory:
nothing is copied). Everywhere else (prefill chunks, wider batches, other
dtypes, quantized layers, mlx-lm's own generation on the same model) MLX's
matmul runs. The price is one ``mx.eval`` where a layer's input was not
evaluated yet (four a decoder layer), which is why this stops at 16 rows.

Why a class swap: mlx-lm's layers call ``nn.Linear.__call__``; only the layer
objects can route one model's products without touching every other model.
The backend swaps them back when it detaches.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.distributed.local_ranks import process_cores
from engine.runtime.runner.backends.cpu.parallel_gate import PARALLEL

# Rows up to which a layer inside MLX's forward takes the pass: each call evaluates its input first, which
# the pass's lead pays for up to 16 agents (Gemma 3 270M, 16 agents decoding: 68.7-69.7 tok/s against
# 67.4-67.9 at 8, where the pass cost what it saved at 16 rows before it fetched ahead).
MAX_ROWS = 16
# Rows up to which a step run whole on the host (``host_forward``, no evaluation per layer) takes the pass:
# 16 agents with drafts, or 8 agents' tokens and 7 drafts each in a verification. At 64 rows it is a little
# faster than BLAS alone (115-118 ms against 128-132 over SmolLM2's weights), and BLAS's threads then spin on
# the cores the step's compiled loops use next.
HOST_STEP_MAX_ROWS = 64
# numba's work-queue threading layer (where OpenMP is missing) is one per process and must not be entered
# from two threads at once; a second caller takes BLAS's product instead of waiting.
_busy = PARALLEL
# Threads the pass splits its outputs across: this process's cores (ranks sharing a host split them), up to 8.
THREADS = min(8, process_cores())


class ProductRouter(Protocol):
    """Who decides, per call, whether a layer's product runs through the pass (the CPU backend)."""

    def few_rows(self, x: mx.array, weights: mx.array, head: bool = False) -> mx.array | None:
        """``head``: the model's output layer (the last product of a pass)."""


def product(x: mx.array, weights: mx.array) -> mx.array | None:
    """``x @ weights.T`` through the compiled pass for float32 inputs of 1 to ``MAX_ROWS`` rows; None where
    MLX's matmul should run."""
    if not (x.dtype == mx.float32 and weights.dtype == mx.float32 and weights.ndim == 2):
        return None
    inner = x.shape[-1]
    rows = x.size // inner if inner else 0
    if not 0 < rows <= MAX_ROWS:
        return None
    mx.eval(x, weights)
    out = times(np.asarray(x).reshape(rows, inner), np.asarray(weights))
    return None if out is None else mx.array(out.reshape(*x.shape[:-1], out.shape[-1]))


def times(x: np.ndarray, weights: np.ndarray, max_rows: int = MAX_ROWS) -> np.ndarray | None:
    """``x @ weights.T`` for ``x`` (rows, inner) through the compiled pass; None where it does not run: more
    than ``max_rows`` rows, weights that are not one C-contiguous float32 buffer (a view of another array:
    BLAS reads it where it lies, a copy would cost more), or another thread inside it."""
    if not (0 < x.shape[0] <= max_rows and weights.dtype == np.float32 and weights.flags.c_contiguous):
        return None
    if not _busy.acquire(blocking=False):
        return None
    try:
        from engine.runtime.runner.backends.cpu import linear_kernel  # (numba: only where the CPU decodes)

        out = np.empty((x.shape[0], weights.shape[0]), dtype=np.float32)
        linear_kernel.times_transposed(np.ascontiguousarray(x, dtype=np.float32), weights, out, THREADS)
    finally:
        _busy.release()
    return out


def warm_up() -> None:
    """Load (the first time: compile) the pass; raises where it cannot load."""
    from engine.runtime.runner.backends.cpu.linear_kernel import times_transposed

    # Compiled (or loaded from numba's cache) outside the gate, which then holds only a tiny run.
    times_transposed.compile("(float32[:, ::1], float32[:, ::1], float32[:, ::1], int64)")
    with PARALLEL:
        times_transposed(np.ones((2, 8), np.float32), np.ones((5, 8), np.float32), np.empty((2, 5), np.float32), 2)


class HostLinear(nn.Linear):
    """``nn.Linear`` whose products its router may take (see :func:`layer_classes`)."""

    router: ProductRouter
    is_head = False

    def __call__(self, x: mx.array) -> mx.array:
        out = self.router.few_rows(x, self["weight"], head=self.is_head)
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out


class HostHead(HostLinear):
    """A model's output layer (``lm_head``): the router is told it is the head."""

    is_head = True


class HostEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied output layer) does the same."""

    router: ProductRouter

    def as_linear(self, x: mx.array) -> mx.array:
        out = self.router.few_rows(x, self.weight, head=True)
        return super().as_linear(x) if out is None else out


def layer_classes(router: ProductRouter) -> tuple[type[HostLinear], type[HostHead], type[HostEmbedding]]:
    """The classes, bound to ``router`` (one backend's): a model's layers take them while it is attached."""
    linear = type("HostLinear", (HostLinear,), {"router": router})
    head = type("HostHead", (HostHead,), {"router": router})
    embedding = type("HostEmbedding", (HostEmbedding,), {"router": router})
    return linear, head, embedding


def swap_in(model: Any, router: ProductRouter) -> int:
    """Give the model's ``nn.Linear`` and ``nn.Embedding`` layers ``router``'s classes; returns how many.

    Only the exact classes are replaced (a subclass, such as a LoRA layer,
    keeps its own ``__call__``), or layers another router had taken;
    parameters, names and saving are unchanged.
    """
    linear, head, embedding = layer_classes(router)
    swapped = 0
    for name, module in model.named_modules():
        if type(module) is nn.Linear or isinstance(module, HostLinear):
            module.__class__ = head if name.rpartition(".")[2] == "lm_head" else linear
            swapped += 1
        elif type(module) is nn.Embedding or isinstance(module, HostEmbedding):
            module.__class__ = embedding
            swapped += 1
    return swapped


def swap_out(model: Any, router: ProductRouter) -> None:
    """Give ``router``'s layers their MLX classes back."""
    for _, module in model.named_modules():
        if isinstance(module, HostLinear) and module.router is router:
            module.__class__ = nn.Linear
        elif isinstance(module, HostEmbedding) and module.router is router:
            module.__class__ = nn.Embedding
