"""A long prefill chunk's attention with its softmax in ``softmax_kernel``: scores and products stay in MLX.

A chunk of ``n`` queries over ``L`` keys runs in blocks of queries whose
scores fit ``BLOCK_SCORES``: each block's scores (one BLAS product per key
head, grouped queries stacked) are evaluated, turned into weights in place
by the compiled rows (both cores, each row in the CPU's cache), and the
weights times the values go back into MLX's graph. A causal chunk's future
keys are cut per row by the kernel, not by a mask pass over the scores.

Measured on the Qwen3.5-0.8B-shaped bench model (8 query heads of 256 over
2 key heads), one call of 466 queries over 20,781 keys, the 2-core x86
box: MLX's fused attention 1.46 s, ``cpu_math.attention`` 1.29 s,
this 0.48 s (blocks of 2**22 scores: 0.63 s, 2**26: 0.44 s). The two products
take ~0.35 s of the call everywhere; the softmax took the rest
(``docs/performance.md``).

Writing the weights into the scores' own buffer: the scores are a fresh
product (or mask) output that nothing else holds, evaluated before the
write, and the values' product reads them only after it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from engine.runtime.runner.backends.cpu import cpu_math
from engine.runtime.runner.backends.cpu.parallel_gate import PARALLEL

# Scores per block (64 MiB of float32): few enough blocks that their evaluations (each one stops MLX's
# graph) do not add up, small enough that a 32K-token chunk's scores are never all held at once.
BLOCK_SCORES = 1 << 24


class RowSoftmax:
    """The compiled softmax rows, once loaded in this process (``warm_up``, in the background).

    Until then, where it cannot load, and while another thread is in a
    parallel compiled loop (``parallel_gate.py``), :meth:`in_place` declines
    and the caller keeps MLX's arithmetic.
    """

    def __init__(self) -> None:
        self.ready = False

    def warm_up(self) -> None:
        """Load (the first time: compile) the kernel; raises where it cannot load."""
        from engine.runtime.runner.backends.cpu.softmax_kernel import softmax_rows  # (numba: the CPU backend only)

        softmax_rows.compile("(float32[:, ::1], int64[::1])")  # outside the gate, which then holds a tiny run
        with PARALLEL:
            softmax_rows(np.zeros((2, 4), np.float32), np.array([4, 1], np.int64))
        self.ready = True

    def in_place(self, scores: mx.array, visible: np.ndarray | None = None) -> bool:
        """Turn the last axis of float32 ``scores`` into softmax weights in its own buffer (evaluating it);
        ``visible``: per row (all axes but the last, flattened), how many leading scores take part.
        False (nothing written): MLX's softmax is the caller's."""
        if not self.ready or scores.dtype != mx.float32:
            return False
        mx.eval(scores)
        rows = np.asarray(memoryview(scores))
        if not (rows.flags.c_contiguous and rows.flags.writeable):
            return False
        rows = rows.reshape(-1, rows.shape[-1])
        if visible is None:
            visible = np.full(rows.shape[0], rows.shape[1], np.int64)
        if not PARALLEL.acquire(blocking=False):
            return False  # another thread is in a parallel loop: MLX's softmax
        try:
            from engine.runtime.runner.backends.cpu.softmax_kernel import softmax_rows

            softmax_rows(rows, visible)
        finally:
            PARALLEL.release()
        return True


ROW_SOFTMAX = RowSoftmax()


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
              fallback_softmax: Any) -> mx.array:
    """Scaled dot-product attention of ``n > 1`` queries (B, H, n, D) over keys/values (B, KV, L, D).

    ``mask``: None, ``"causal"`` (the last ``n`` keys are the queries'
    positions) or an array (boolean: True attends; or additive) broadcastable
    to (B, H, n, L). A block the kernel declines takes ``fallback_softmax``.
    """
    batch, q_heads, n, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    repeats = q_heads // kv_heads
    block = max(1, BLOCK_SCORES // (batch * q_heads * length))
    q = queries * mx.array(scale, dtype=queries.dtype)
    outputs = []
    for start in range(0, n, block):
        end = min(n, start + block)
        if isinstance(mask, str):
            visible_keys = length - n + end  # this block's last query sees up to its own position
            k, v = keys[:, :, :visible_keys], values[:, :, :visible_keys]
            # Row order (B, KV, R, queries): query i of the block sees keys [0, length - n + start + i].
            per_query = np.arange(length - n + start + 1, length - n + end + 1, dtype=np.int64)
            visible = np.tile(per_query, batch * q_heads)
        else:
            k, v, visible = keys, values, None
        rows = end - start
        scores = q[:, :, start:end].reshape(batch, kv_heads, repeats * rows, dim) @ k.swapaxes(-1, -2)
        if scores.dtype != mx.float32:
            scores = scores.astype(mx.float32)
        if mask is not None and not isinstance(mask, str):
            scores = _grouped_mask(scores, cpu_math.mask_rows(mask, start, end), rows)
        if ROW_SOFTMAX.in_place(scores, visible):
            weights = scores
        else:  # MLX's softmax: a causal block's future keys masked as cpu_math masks them
            weights = fallback_softmax(_grouped_mask(scores, mask, rows) if visible is not None else scores)
        out = weights.astype(v.dtype) @ v
        outputs.append(out.reshape(batch, q_heads, rows, v.shape[-1]))
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)


def _grouped_mask(scores: mx.array, mask: Any, rows: int) -> mx.array:
    """``cpu_math.apply_mask`` on (B, KV, R * rows, L) scores: the grouped queries split out, and back."""
    batch, kv_heads, stacked, length = scores.shape
    shaped = scores.reshape(batch, kv_heads, stacked // rows, rows, length)
    return cpu_math.apply_mask(shaped, mask, rows, length).reshape(scores.shape)


def warm_up() -> None:
    ROW_SOFTMAX.warm_up()
