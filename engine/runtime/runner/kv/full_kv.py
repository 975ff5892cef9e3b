"""Full-attention K/V of one sequence: shared segments, then its own tail written in place.

Positions ``[0, base)`` come from shared segments (``prefix``: one K/V pair
per segment, this layer's part); positions ``[base, offset)`` sit in the
sequence's own arrays, whose capacity the pool has paid for. With no
segments this is mlx-lm's ``KVCache``; with segments the attention hook
(``ragged.py``) attends over the parts without joining them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.runtime.runner.kv.attention import MLX_ATTENTION, Attention


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one token of one layer stores."""

    heads: int
    k_dim: int
    v_dim: int
    dtype: mx.Dtype
    # Held quantized (``quantized_kv.py``): bits a value and the values a scale and bias cover; None: plain.
    bits: int | None = None
    group_size: int = 64

    def token_bytes(self) -> int:
        if self.bits is None:
            return self.heads * (self.k_dim + self.v_dim) * self.dtype.size
        return self.heads * sum(dim * self.bits // 8 + dim // self.group_size * 2 * self.dtype.size
                                for dim in (self.k_dim, self.v_dim))


class FullKV(KVCache):
    """mlx-lm's ``KVCache`` semantics with explicit, block-aligned capacity.

    ``KVCache`` grows by itself while the model runs, 256 tokens at a time and
    by copying everything it holds; here growth happens only through
    :meth:`reserve`, called by the engine after the pool has granted the
    blocks, so the bytes held always equal the bytes the pool counts.
    """

    # How a sequence on this cache attends (a backend's cache kinds may bring their own: kinds.py).
    attention: Attention = MLX_ATTENTION

    def __init__(self, shape: KVShape, block_tokens: int) -> None:
        super().__init__()
        self.shape = shape
        self.block_tokens = block_tokens
        self.base = 0
        self.prefix: list[tuple[mx.array, mx.array]] = []

    # -- capacity --------------------------------------------------------------------
    @property
    def own_capacity(self) -> int:
        return 0 if self.keys is None else length_of(self.keys)

    @property
    def capacity(self) -> int:
        """Positions this layer can hold without growing (shared ones included)."""
        return self.base + self.own_capacity

    def capacity_for(self, n_tokens: int) -> int:
        """Capacity after a :meth:`reserve` of ``n_tokens``: whole blocks, grown by at least 1/8.

        Growing by a fraction amortizes the copy a growth costs; 1/8 bounds the
        memory held beyond what is used.
        """
        if n_tokens <= self.capacity:
            return self.capacity
        step = max(self.block_tokens, self.own_capacity // 8)
        return self.base + _round_up(max(n_tokens, self.capacity + step) - self.base, self.block_tokens)

    def reserve(self, n_tokens: int) -> int:
        """Make room for ``n_tokens`` positions; returns bytes copied by the growth."""
        target = self.capacity_for(n_tokens) - self.base
        if target == self.own_capacity:
            return 0
        return self._regrow(target)

    def fitted_capacity(self) -> int:
        """The most own capacity a settled cache keeps: its positions plus the growth step."""
        used = self.offset - self.base
        return _round_up(used + max(self.block_tokens, used // 8), self.block_tokens)

    def shrink(self) -> int:
        """Give back capacity a cut left far beyond the positions held; returns bytes copied."""
        if self.own_capacity <= self.fitted_capacity():
            return 0
        used = self.offset - self.base
        return self._regrow(max(_round_up(used, self.block_tokens), self.block_tokens))

    def _regrow(self, capacity: int) -> int:
        """New own arrays of ``capacity`` positions holding the ones written; returns bytes copied."""
        used = self.offset - self.base
        self.keys = self._grown(self.keys, used, capacity, self.shape.k_dim)
        self.values = self._grown(self.values, used, capacity, self.shape.v_dim)
        self._arrays_replaced(used)
        return used * self.shape.token_bytes()

    def _grown(self, old: Held | None, used: int, capacity: int, dim: int) -> Held:
        new = self._empty(capacity, dim)
        if old is not None and used:
            for n, o in zip(parts_of(new), parts_of(old)):
                n[..., :used, :] = o[..., :used, :]
        return new

    def _empty(self, capacity: int, dim: int) -> Held:
        """Own arrays of ``capacity`` positions of one K or V ``dim`` wide (a subclass may pack them)."""
        return mx.zeros((1, self.shape.heads, capacity, dim), dtype=self.shape.dtype)

    def _arrays_replaced(self, written: int) -> None:
        """New own arrays were just made, holding ``written`` positions (a subclass may track what was written)."""

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's own arrays (segments are counted where they are shared)."""
        return self.own_capacity * self.shape.token_bytes()

    # -- the model's interface -----------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.held(self._write(keys, values))

    def held(self, n: int) -> tuple[Held, Held]:
        """The first ``n`` own positions (views)."""
        return cut(self.keys, 0, n), cut(self.values, 0, n)

    def append_one(self, keys: mx.array, values: mx.array) -> int:
        """A decode step's position, without the views :meth:`update_and_fetch` makes (a batch's attention
        may read the arrays themselves); returns how many leading positions of them attention reads."""
        return self._write(keys, values)

    def _write(self, keys: mx.array, values: mx.array) -> int:
        start, end = self.offset - self.base, self.offset - self.base + keys.shape[2]
        if end > self.own_capacity:
            raise RuntimeError(f"KV capacity {self.capacity} reached at {self.base + end} tokens: reserve() first")
        self._store(start, end, keys, values)
        self.offset += keys.shape[2]
        return end

    def _store(self, start: int, end: int, keys: mx.array, values: mx.array) -> None:
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values

    def trim_to(self, n_tokens: int) -> None:
        if n_tokens < self.base:
            raise ValueError(f"cannot trim into the shared prefix ({n_tokens} < {self.base}): re-base first")
        self.offset = min(self.offset, n_tokens)

    # -- positions ---------------------------------------------------------------------
    def positions(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Views (or a join, across parts) of positions ``[start, end)``."""
        pieces: list[tuple[Held, Held]] = []
        at = 0
        for k, v in self.prefix:
            length = length_of(k)
            a, b = max(start, at), min(end, at + length)
            if a < b:
                pieces.append((cut(k, a - at, b - at), cut(v, a - at, b - at)))
            at += length
        a, b = max(start, self.base), end
        if a < b:
            pieces.append((cut(self.keys, a - self.base, b - self.base), cut(self.values, a - self.base, b - self.base)))
        if len(pieces) == 1:
            return pieces[0]
        return joined([p[0] for p in pieces]), joined([p[1] for p in pieces])

    def head(self, n_tokens: int) -> tuple[mx.array, mx.array]:
        """Positions ``[0, n_tokens)``."""
        return self.positions(0, n_tokens)

    def load(self, keys: mx.array, values: mx.array) -> None:
        """Write ``keys``/``values`` as the positions right after the prefix (capacity reserved by the caller)."""
        n = length_of(keys)
        self._store(0, n, keys, values)
        self.offset = self.base + n

    def rebase(self, prefix: list[tuple[mx.array, mx.array]], capacity: int) -> int:
        """Take ``prefix`` as positions ``[0, base)`` and keep own arrays of ``capacity`` positions in total.

        Positions between the new base and ``offset`` that the new prefix does
        not cover are copied into new own arrays; returns bytes copied.
        """
        base = sum(length_of(k) for k, _ in prefix)
        tail_k, tail_v = self.positions(base, self.offset) if self.offset > base else (None, None)
        own = capacity - base
        self.keys = self._empty(own, self.shape.k_dim)
        self.values = self._empty(own, self.shape.v_dim)
        offset = max(self.offset, base)
        self._arrays_replaced(0)
        if tail_k is not None:
            self._store(0, offset - base, tail_k, tail_v)
        self.prefix, self.base, self.offset = prefix, base, offset
        return (offset - base) * self.shape.token_bytes()


# One K or V as a layer holds it: an array, or packed (quantized_kv.py) a tuple of arrays (words, scales,
# biases), every one with the positions on axis 2.
Held = Any


def parts_of(held: Held) -> tuple[mx.array, ...]:
    return held if isinstance(held, tuple) else (held,)


def length_of(held: Held) -> int:
    """Positions a K or V holds (axis 2), packed or not."""
    return parts_of(held)[0].shape[2]


def cut(held: Held, start: int, end: int) -> Held:
    """Positions ``[start, end)`` of a K or V (views; of each array of a packed one)."""
    if isinstance(held, tuple):
        return tuple(a[..., start:end, :] for a in held)
    return held[..., start:end, :]


def joined(pieces: list[Held]) -> Held:
    """Runs of one K or V joined along the positions (each array of packed ones)."""
    if isinstance(pieces[0], tuple):
        return tuple(mx.concatenate([p[i] for p in pieces], axis=2) for i in range(len(pieces[0])))
    return mx.concatenate(pieces, axis=2)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step
