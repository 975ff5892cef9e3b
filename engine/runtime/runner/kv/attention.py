"""The attention arithmetic a layer cache's sequence runs with: MLX's fused kernel, or a backend's own.

Every layer cache the engine builds carries an :class:`Attention` (a class
attribute of its kind, see ``kinds.py``), so the attention hook
(``ragged.py``) asks the cache it was handed how to attend: the decision is
made once, when the backend picks the cache kinds, never per call from a
flag. mlx-lm's own caches (its generation on the same model object) have
none, and keep mlx-lm's attention.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx


class Attention(Protocol):
    def sdpa(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
             sinks: Any = None) -> mx.array:
        """One sequence's scaled dot-product attention."""

    def softmax(self, scores: mx.array) -> mx.array:
        """Attention weights over the last axis (shared segments' joined scores), in float32. ``scores`` is
        the caller's to give away: the CPU backend may write the weights into its buffer."""


class MlxAttention:
    """MLX's fused attention and precise softmax: what Metal, CUDA and ``--no-fast-cpu-math`` run."""

    def sdpa(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
             sinks: Any = None) -> mx.array:
        if sinks is None:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def softmax(self, scores: mx.array) -> mx.array:
        return mx.softmax(scores, axis=-1, precise=True)


MLX_ATTENTION = MlxAttention()
