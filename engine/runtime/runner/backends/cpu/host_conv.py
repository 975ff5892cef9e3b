"""A prefill chunk's depthwise ``nn.Conv1d`` on the CPU, through ``depthwise_conv_kernel`` instead of MLX's.

The CPU backend wraps ``nn.Conv1d.__call__`` (``hooks.py``) inside its own
forward pass. :func:`depthwise` takes a stride-1, unpadded, undilated
convolution with one filter per channel (``groups`` equal to the channels:
the recurrent layers' short convolutions) over ``MIN_STEPS`` output
positions or more; anything else (a decode step's few positions, a grouped
or strided convolution) returns None and MLX's convolution runs.

Leaving MLX's graph costs one evaluation of the layer's projections before
it; a chunk wins that back many times (the kernel's docstring).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from engine.runtime.runner.backends.cpu.parallel_gate import PARALLEL

# Fewer output positions than this stay in MLX (a decode step, a speculative verify of a few tokens).
MIN_STEPS = 16


def takes(conv: Any, x: mx.array) -> bool:
    """Whether ``conv`` (an ``nn.Conv1d``) over ``x`` (B, L, C) is a depthwise chunk this path computes."""
    weight = conv.weight
    channels, taps = weight.shape[0], weight.shape[1]
    return (x.ndim == 3 and weight.ndim == 3 and weight.shape[2] == 1 and conv.groups == channels == x.shape[2]
            and conv.stride == 1 and conv.padding == 0 and conv.dilation == 1
            and x.shape[1] - taps + 1 >= MIN_STEPS and x.dtype in (mx.float32, mx.bfloat16, mx.float16))


def depthwise(conv: Any, x: mx.array) -> mx.array | None:
    """``conv(x)`` for a depthwise chunk (:func:`takes`), in ``x``'s dtype; None where MLX should run it."""
    if not takes(conv, x):
        return None
    from engine.runtime.runner.backends.cpu import depthwise_conv_kernel  # (numba: only where the CPU prefills)

    inputs, weight = x.astype(mx.float32), conv.weight.astype(mx.float32)
    mx.eval(inputs, weight)
    x_ = np.ascontiguousarray(np.asarray(memoryview(inputs)))  # (a view of MLX's buffer, read only)
    w_ = np.ascontiguousarray(np.asarray(memoryview(weight))[:, :, 0].T)  # (K, C): a channel's taps apart
    y = np.empty((x_.shape[0], x_.shape[1] - w_.shape[0] + 1, x_.shape[2]), dtype=np.float32)
    if not PARALLEL.acquire(blocking=False):
        return None  # another thread is in a parallel loop (see parallel_gate.py): MLX's convolution
    try:
        depthwise_conv_kernel.depthwise(x_, w_, y)
    finally:
        PARALLEL.release()
    out = mx.array(y).astype(x.dtype)
    return out + conv.bias if "bias" in conv else out  # (after the sum, as nn.Conv1d adds it)


def warm_up() -> None:
    """Load (the first time: compile) the loop; raises where it cannot load."""
    from engine.runtime.runner.backends.cpu.depthwise_conv_kernel import depthwise as loop

    loop.compile("(float32[:, :, ::1], float32[:, ::1], float32[:, :, ::1])")  # outside the gate
    with PARALLEL:
        loop(np.ones((1, 5, 3), np.float32), np.ones((4, 3), np.float32), np.empty((1, 2, 3), np.float32))
