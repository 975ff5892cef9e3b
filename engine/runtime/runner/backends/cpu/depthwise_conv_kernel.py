"""A recurrent layer's short causal convolution over a prefill chunk, in one compiled loop (numba).

Qwen3.5, Qwen3-Next, Kimi Linear, Mamba, Nemotron-H, Falcon-H1, LFM2 and the
other hybrids run a depthwise ``nn.Conv1d`` (one filter of 4 taps per channel) before
their recurrence. MLX's CPU convolution loops over the channels one group at
a time: on the Qwen3.5-0.8B-shaped bench model (6,144 channels), a
512-token chunk's convolution took 75.6 ms a layer, here 3.9 ms (the 2-core
x86 box; ``docs/performance.md``).

The sum is MLX's to the bit: each output starts at 0 and adds its taps in
order with a fused multiply-add (``contract``; measured equal to
``mx.conv1d`` in float32, and in bfloat16 once rounded back). No
reassociation: the taps' order is what makes it exact.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, fastmath={"contract"}, parallel=True, cache=True)
def depthwise(x, w, y):  # pragma: no cover (compiled)
    """``y[b, t, c] = sum_k x[b, t + k, c] * w[k, c]`` (x: (B, T + K - 1, C); w: (K, C); y: (B, T, C); all
    C-contiguous float32); output positions across threads."""
    batch, steps, channels = y.shape
    taps = w.shape[0]
    for position in numba.prange(batch * steps):
        b, t = position // steps, position % steps
        for c in range(channels):
            total = np.float32(0.0)
            for k in range(taps):
                total += x[b, t + k, c] * w[k, c]
            y[b, t, c] = total
