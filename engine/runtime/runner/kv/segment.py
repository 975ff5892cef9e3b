"""Shared prefixes: frozen spans of the full-attention layers, referenced by several agents.

A :class:`Segment` holds positions ``[start, end)`` of every full-attention
layer, in whole blocks, and is never written again. Agents whose prompts
begin the same way refer to the same segments; the pool counts a segment's
blocks once, held by every agent that refers to it (its refcount). An agent
that goes on past a shared prefix writes only its own tail (copy on write:
the partial block after the prefix is copied, never the prefix).

Attention over ``[segments..., own tail]`` concatenates the per-segment
scores and takes one softmax, so it equals attention over the concatenated
keys without ever concatenating them (:func:`segmented_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from engine.runtime.runner.kv.attention import MLX_ATTENTION, Attention
from engine.runtime.runner.kv.full_kv import length_of, parts_of


@dataclass(eq=False, slots=True)
class Segment:
    start: int
    end: int
    keys: tuple[mx.array, ...]  # one (1, heads, end - start, k_dim) array per full-attention layer
    values: tuple[mx.array, ...]
    # Pool block ids per full-attention group: the blocks that pay for this segment.
    blocks: dict[int, list[int]] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def block_ids(self) -> list[int]:
        return [b for group in sorted(self.blocks) for b in self.blocks[group]]

    def array_bytes(self) -> int:
        return sum(a.nbytes for held in (*self.keys, *self.values) for a in parts_of(held))


def segmented_attention(
    queries: mx.array, parts: Sequence[tuple[mx.array, mx.array]], scale: float, mask: Any,
    attention: Attention = MLX_ATTENTION,
) -> mx.array:
    """Scaled dot-product attention over keys/values given in consecutive parts.

    The same arithmetic as MLX's unfused attention (scaled queries, one
    precise softmax over all scores, ``attention.softmax``), so results match
    ``mx.fast.scaled_dot_product_attention`` up to the order of the final sum.
    """
    batch, q_heads, n, dim = queries.shape
    kv_heads = parts_of(parts[0][0])[0].shape[1]
    repeats = q_heads // kv_heads
    q = (queries * scale).reshape(batch, kv_heads, repeats, n, dim)
    scores = mx.concatenate([_product(q, k, attention, transpose=True) for k, _ in parts], axis=-1)
    scores = _masked(scores, mask, n)
    weights = attention.softmax(scores)
    out = None
    start = 0
    for _, v in parts:
        length = length_of(v)
        piece = _product(weights[..., start:start + length], v, attention, transpose=False)
        out = piece if out is None else out + piece
        start += length
    assert out is not None
    return out.reshape(batch, q_heads, n, out.shape[-1])


def _product(left: mx.array, held: Any, attention: Attention, transpose: bool) -> mx.array:
    """``left`` (batch, kv heads, repeats, rows, width) times a part's keys (transposed: scores) or values
    (weighted sum); a packed part through its attention's quantized product (``quantized_kv.py``)."""
    if isinstance(held, tuple):
        return attention.product(left, held, transpose)  # type: ignore[attr-defined]
    held = mx.expand_dims(held, 2)
    return left @ (held.swapaxes(-1, -2) if transpose else held)


def _masked(scores: mx.array, mask: Any, n: int) -> mx.array:
    if mask is None:
        return scores
    if isinstance(mask, str):
        total = scores.shape[-1]
        mask = create_causal_mask(n, total - n)
    if mask.dtype == mx.bool_:
        # (.., n, L) masks broadcast over the repeat axis the grouped queries add.
        return mx.where(_grouped(mask), scores, mx.finfo(scores.dtype).min)
    return scores + _grouped(mask)


def _grouped(mask: mx.array) -> mx.array:
    return mx.expand_dims(mask, -3) if mask.ndim >= 3 else mask
