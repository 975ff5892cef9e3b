"""The gated delta rule's recurrence over a prefill chunk, in one compiled loop per head (numba).

Qwen3.5, Qwen3-Next, Kimi Linear and the other gated-delta hybrids update a
state of ``[Dv, Dk]`` floats per head once per token. mlx-lm runs that on
Metal as a kernel; everywhere else as ``gated_delta_ops``: one compiled MLX
step per token, a few operations over the whole state each, so a 466-token
chunk of a Qwen3.5-0.8B-shaped model's six recurrent layers is ~2,800 steps
of ~1 MB passes, each a hand-off to MLX's CPU stream: 4.0 of the chunk's
5.4 s on this project's 2-core x86 machines.

Here each head's state row (``Dk`` floats) stays in the CPU's cache while
one pass decays it, reads the key's projection, adds the delta and reads
the query's: the same arithmetic as ``_gated_delta_step_ops`` (decay, then
``kv = state @ k``, ``delta = (v - kv) * beta``, ``state += k * delta``,
``y = state @ q``), with its sums over ``Dk`` reassociated for SIMD
(``fastmath`` reassoc and contract only), as BLAS's sums are; the
real-model tests hold greedy tokens to mlx-lm's. Heads are split across
threads (``parallel``).
"""

from __future__ import annotations

import numba
import numpy as np

_FAST = {"reassoc", "contract"}


@numba.njit(nogil=True, fastmath=_FAST, parallel=True, cache=True)
def recurrence(q, k, v, g, beta, state, y):  # pragma: no cover (compiled)
    """Run ``T`` steps; ``state`` is updated in place and ``y`` written.

    ``q``, ``k``: (B, T, Hk, Dk); ``v``: (B, T, Hv, Dv); ``g``, ``beta``: (B, T, Hv);
    ``state``: (B, Hv, Dv, Dk); ``y``: (B, T, Hv, Dv). All C-contiguous float32;
    value head ``h`` reads key head ``h // (Hv // Hk)`` (mlx-lm's ``mx.repeat``).
    """
    batch, steps, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    repeat = value_heads // key_heads
    for bh in numba.prange(batch * value_heads):
        b = bh // value_heads
        h = bh % value_heads
        hk = h // repeat
        s = state[b, h]
        for t in range(steps):
            decay = g[b, t, h]
            rate = beta[b, t, h]
            kt = k[b, t, hk]
            qt = q[b, t, hk]
            vt = v[b, t, h]
            for i in range(value_dim):
                row = s[i]
                kv = np.float32(0.0)
                for j in range(key_dim):
                    x = row[j] * decay
                    row[j] = x
                    kv += x * kt[j]
                delta = (vt[i] - kv) * rate
                out = np.float32(0.0)
                for j in range(key_dim):
                    x = row[j] + kt[j] * delta
                    row[j] = x
                    out += x * qt[j]
                y[b, t, h, i] = out
