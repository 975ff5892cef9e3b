"""Queries, keys, values and masks for attention tests (the CPU backend's attention against MLX's)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask


def qkv(batch: int, n: int, length: int, heads: int = 9, kv_heads: int = 3, dim: int = 64,
        dtype: mx.Dtype = mx.float32) -> tuple[mx.array, mx.array, mx.array]:
    """``n`` queries over ``length`` keys, seeded by the shape."""
    keys = mx.random.split(mx.random.key(n * 1000 + length), 3)
    q = mx.random.normal((batch, heads, n, dim), key=keys[0]).astype(dtype)
    k = mx.random.normal((batch, kv_heads, length, dim), key=keys[1]).astype(dtype)
    v = mx.random.normal((batch, kv_heads, length, dim), key=keys[2]).astype(dtype)
    return q, k, v


def make_mask(kind: str, batch: int, n: int, length: int, heads: int = 9) -> object:
    """An attention mask of each kind mlx-lm's models pass, for ``n`` queries over ``length`` keys."""
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    if kind == "bool":
        return create_causal_mask(n, length - n)
    if kind == "additive":
        return mx.where(create_causal_mask(n, length - n), 0.0, -1e9).astype(mx.float32)
    if kind == "per-head bool":
        mask = mx.random.bernoulli(0.7, (batch, heads, n, length), key=mx.random.key(5))
        mask[..., 0] = True  # every query sees at least one key
        return mask
    if kind == "per-row bool":  # the second row sees its first 25 keys only
        return mx.arange(length)[None, None, None, :] < mx.array([length, 25][:batch])[:, None, None, None]
    if kind == "one-row bool":
        return mx.arange(length)[None, :] < 250
    raise ValueError(kind)
