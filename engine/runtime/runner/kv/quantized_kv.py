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
runs), on every device. The CPU backend's host paths read float32
arrays and step aside for these layers.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from engine.runtime.runner.kv.full_kv import FullKV, KVShape, _round_up

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


def is_packed(array: Any) -> bool:
    return isinstance(array, tuple)


def length_of(array: mx.array | Packed) -> int:
    """Positions a K or V holds (axis 2), packed or not."""
    return (array[0] if isinstance(array, tuple) else array).shape[2]


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

    @property
    def own_capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def reserve(self, n_tokens: int) -> int:
        target = self.capacity_for(n_tokens) - self.base
        if target == self.own_capacity:
            return 0
        return self._regrow(target)

    def shrink(self) -> int:
        if self.own_capacity <= self.fitted_capacity():
            return 0
        used = self.offset - self.base
        return self._regrow(max(_round_up(used, self.block_tokens), self.block_tokens))

    def _regrow(self, capacity: int) -> int:
        used = self.offset - self.base
        self.keys = self._grown(self.keys, used, capacity, self.shape.k_dim)
        self.values = self._grown(self.values, used, capacity, self.shape.v_dim)
        self._arrays_replaced(used)
        return used * self.shape.token_bytes()

    def _grown(self, old: Packed | None, used: int, capacity: int, dim: int) -> Packed:
        new = self._empty(capacity, dim)
        if old is not None and used:
            for n, o in zip(new, old):
                n[..., :used, :] = o[..., :used, :]
        return new

    def _empty(self, capacity: int, dim: int) -> Packed:
        heads, bits, group = self.shape.heads, self.bits, self.group_size
        return (mx.zeros((1, heads, capacity, dim * bits // 32), dtype=mx.uint32),
                mx.zeros((1, heads, capacity, dim // group), dtype=self.shape.dtype),
                mx.zeros((1, heads, capacity, dim // group), dtype=self.shape.dtype))

    # -- the model's interface -----------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Packed, Packed]:  # type: ignore[override]
        end = self._write(keys, values)
        return self.held(end)

    def held(self, n: int) -> tuple[Packed, Packed]:
        """The first ``n`` own positions, packed (views)."""
        assert self.keys is not None and self.values is not None
        return _cut(self.keys, 0, n), _cut(self.values, 0, n)

    def _store(self, start: int, end: int, keys: mx.array | Packed, values: mx.array | Packed) -> None:
        """Write positions ``[start, end)`` of the own arrays, packing what is not packed yet (a position is
        quantized once: packed arrays, a shared prefix's or another agent's, are copied as they are)."""
        assert self.keys is not None and self.values is not None
        for own, new in ((self.keys, keys), (self.values, values)):
            packed = new if is_packed(new) else self.pack(new)
            for o, p in zip(own, packed):
                o[..., start:end, :] = p

    def pack(self, array: mx.array) -> Packed:
        return tuple(mx.quantize(array.astype(self.shape.dtype), group_size=self.group_size, bits=self.bits))  # type: ignore[return-value]

    # -- positions ---------------------------------------------------------------------
    def positions(self, start: int, end: int) -> tuple[Packed, Packed]:  # type: ignore[override]
        """Positions ``[start, end)`` packed: views of one part, or each array joined across parts."""
        pieces: list[tuple[Packed, Packed]] = []
        at = 0
        for k, v in self.prefix:
            length = length_of(k)
            a, b = max(start, at), min(end, at + length)
            if a < b:
                pieces.append((_cut(k, a - at, b - at), _cut(v, a - at, b - at)))
            at += length
        a, b = max(start, self.base), end
        if a < b:
            assert self.keys is not None and self.values is not None
            pieces.append((_cut(self.keys, a - self.base, b - self.base), _cut(self.values, a - self.base, b - self.base)))
        if len(pieces) == 1:
            return pieces[0]
        return _joined([p[0] for p in pieces]), _joined([p[1] for p in pieces])

    def load(self, keys: mx.array | Packed, values: mx.array | Packed) -> None:  # type: ignore[override]
        n = length_of(keys)
        self._store(0, n, keys, values)
        self.offset = self.base + n

    def rebase(self, prefix: list[tuple[Any, Any]], capacity: int) -> int:
        base = sum(length_of(k) for k, _ in prefix)
        tail = self.positions(base, self.offset) if self.offset > base else None
        own = capacity - base
        self.keys = self._empty(own, self.shape.k_dim)
        self.values = self._empty(own, self.shape.v_dim)
        offset = max(self.offset, base)
        self._arrays_replaced(0)
        if tail is not None:
            self._store(0, offset - base, *tail)
        self.prefix, self.base, self.offset = prefix, base, offset
        return (offset - base) * self.shape.token_bytes()

    def unpacked(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Positions ``[start, end)`` at the model's K/V dtype (what a tier that stores plain arrays takes)."""
        keys, values = self.positions(start, end)
        return self.attention.unpacked(keys).astype(self.shape.dtype), self.attention.unpacked(values).astype(self.shape.dtype)


def _cut(packed: Packed, start: int, end: int) -> Packed:
    return tuple(a[..., start:end, :] for a in packed)  # type: ignore[return-value]


def _joined(parts: Sequence[Packed]) -> Packed:
    return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(3))  # type: ignore[return-value]
