"""Full-attention K/V held quantized in the hot pool (``--kv-bits``): what mlx-lm's ``QuantizedKVCache`` keeps.

Each K and V is packed along the head dimension by ``mx.quantize``: ``bits``
a value in uint32 words, and a scale and a bias per ``group_size`` values,
in the model's K/V dtype. The arrays are the three of that packing, each
with the positions on axis 2 as :class:`FullKV`'s one array has them, so
capacity, growth, shared segments and cut-backs work position for position
as there; the pool pays for exactly the packed bytes (``KVShape.token_bytes``).
A position is quantized once, when it is written; attention reads the packed
arrays through MLX's quantized products (the arithmetic of mlx-lm's
``quantized_scaled_dot_product_attention``, which its own quantized cache
runs) on Metal and CUDA; the CPU backend's kind unpacks them for its own
attention (``HostQuantizedFullKV``), and its decode steps read them in
place in compiled loops (``backends/cpu/host_packed_decode.py``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.runtime.runner.kv.full_kv import FullKV, KVShape, parts_of

# One K or V, packed: (uint32 words, scales, biases), each (1, heads, positions, width).
Packed = tuple[mx.array, mx.array, mx.array]


class QuantizedAttention:
    """Attention over packed K/V: the arithmetic of mlx-lm's quantized attention (scaled queries, MLX's quantized
    product for the scores and for the weighted values, one precise softmax), with each key head's grouped
    queries folded into its rows. (mlx-lm gives the packed K/V a repeat axis of 1 to broadcast against the
    queries' instead; on the CPU, MLX 0.32's quantized product gets that broadcast wrong when the packed arrays
    are contiguous, which a resident cache's often are: tests/unit/test_quantized_kv.py.) MLX's fused kernel
    runs where a model's sinks need it, over the K/V unpacked."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits = bits
        self.group_size = group_size

    def sdpa(self, queries: mx.array, keys: Packed, values: Packed, scale: float, mask: Any,
             sinks: Any = None) -> mx.array:
        if sinks is not None:
            return mx.fast.scaled_dot_product_attention(queries, self.unpacked(keys), self.unpacked(values),
                                                        scale=scale, mask=mask, sinks=sinks)
        batch, q_heads, n, dim = queries.shape
        kv_heads = keys[0].shape[1]
        grouped = (queries * scale).reshape(batch, kv_heads, q_heads // kv_heads, n, dim)
        scores = self.product(grouped, keys, transpose=True)
        if mask is not None:
            if isinstance(mask, str):
                total = scores.shape[-1]
                mask = mx.arange(total - n, total)[:, None] >= mx.arange(total)[None]
            if mask.ndim > 3:
                mask = mx.expand_dims(mask, -3)
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min) if mask.dtype == mx.bool_ else scores + mask
        weights = self.softmax(scores)
        return self.product(weights, values, transpose=False).reshape(batch, q_heads, n, -1)

    def softmax(self, scores: mx.array) -> mx.array:
        return mx.softmax(scores, axis=-1, precise=True)

    def product(self, left: mx.array, packed: Packed, transpose: bool) -> mx.array:
        """``left`` (batch, kv heads, repeats, rows, width) times each key head's packed K transposed (scores)
        or packed V (weighted values): the repeats go into the rows, so each key head's arrays meet their own
        queries with no axis to broadcast."""
        batch, heads, repeats, rows, width = left.shape
        out = mx.quantized_matmul(left.reshape(batch, heads, repeats * rows, width), *packed, transpose=transpose,
                                  group_size=self.group_size, bits=self.bits)
        return out.reshape(batch, heads, repeats, rows, out.shape[-1])

    def unpacked(self, packed: Packed) -> mx.array:
        return mx.dequantize(*packed, group_size=self.group_size, bits=self.bits)


class QuantizedFullKV(FullKV):
    """:class:`FullKV` with its own positions (and its shared segments') held packed."""

    # How its sequence attends, built for the shape's bits (a backend's kind may bring its own: kinds.py).
    attention_kind: type[QuantizedAttention] = QuantizedAttention

    def __init__(self, shape: KVShape, block_tokens: int) -> None:
        if shape.bits is None:
            raise ValueError("a quantized layer cache needs its shape's bits")
        super().__init__(shape, block_tokens)
        self.attention = self.attention_kind(shape.bits, shape.group_size)
        self.keys: Packed | None = None  # type: ignore[assignment]
        self.values: Packed | None = None  # type: ignore[assignment]

    # (mlx-lm's attention dispatch reads these to pick its quantized path for a cache it is handed)
    @property
    def bits(self) -> int:
        return self.attention.bits

    @property
    def group_size(self) -> int:
        return self.attention.group_size

    def _empty(self, capacity: int, dim: int) -> Packed:
        heads, bits, group = self.shape.heads, self.bits, self.group_size
        return (mx.zeros((1, heads, capacity, dim * bits // 32), dtype=mx.uint32),
                mx.zeros((1, heads, capacity, dim // group), dtype=self.shape.dtype),
                mx.zeros((1, heads, capacity, dim // group), dtype=self.shape.dtype))

    def _store(self, start: int, end: int, keys: mx.array | Packed, values: mx.array | Packed) -> None:
        """Write positions ``[start, end)`` of the own arrays, packing what is not packed yet (a position is
        quantized once: packed arrays, a shared prefix's or another agent's, are copied as they are)."""
        assert self.keys is not None and self.values is not None
        for own, new in ((self.keys, keys), (self.values, values)):
            packed = new if isinstance(new, tuple) else self.pack(new)
            for o, p in zip(parts_of(own), packed):
                o[..., start:end, :] = p

    def pack(self, array: mx.array) -> Packed:
        return tuple(mx.quantize(array.astype(self.shape.dtype), group_size=self.group_size, bits=self.bits))  # type: ignore[return-value]
