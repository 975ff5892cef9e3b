"""Sliding-window K/V of one sequence: a ring of whole blocks, and checkpoints of it.

A layer with window W attends, at position p, to positions (p - W, p]. The
ring keeps the last C positions, C = W rounded up to whole blocks, position
p at column p mod C. Attention does not care about the order of keys (they
carry their rotary position already), so the ring is used as it lies for a
decode step; a prefill chunk attends to the last W - 1 positions in
temporal order followed by its own keys, as mlx-lm's ``RotatingKVCache``
does, so outputs match it.

What the ring forgets cannot be recomputed without a prefill. To resume a
conversation from an earlier position (the prompt diverged inside the last
reply), the engine keeps :class:`WindowState` checkpoints: references to the
ring's arrays at the end of a turn's prompt. MLX arrays are values, so a
checkpoint costs nothing when taken; the next write to the ring then copies
it (C positions) instead of writing in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from engine.runtime.runner.kv.attention import MLX_ATTENTION, Attention
from engine.runtime.runner.kv.full_kv import KVShape, _round_up


@dataclass(frozen=True, slots=True)
class WindowState:
    """A window layer's ring at ``offset`` tokens: enough to continue from there."""

    offset: int
    oldest: int
    keys: mx.array | None
    values: mx.array | None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


@dataclass(frozen=True, slots=True)
class RingUndo:
    """A ring's columns a speculative step is about to overwrite, as they were (None: nothing to keep)."""

    offset: int
    oldest: int
    columns: list[int]
    keys: mx.array | None
    values: mx.array | None


class WindowKV(_BaseCache):
    # How a sequence on this cache attends (a backend's cache kinds may bring their own: kinds.py).
    attention: Attention = MLX_ATTENTION

    def __init__(self, shape: KVShape, block_tokens: int, window: int) -> None:
        self.shape = shape
        self.block_tokens = block_tokens
        self.window = window
        self.max_capacity = _round_up(window, block_tokens)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        # Oldest position still in the ring (a trim leaves stale columns behind it).
        self.oldest = 0

    # -- capacity --------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def capacity_for(self, n_tokens: int) -> int:
        return max(self.capacity, min(_round_up(n_tokens, self.block_tokens), self.max_capacity))

    def reserve(self, n_tokens: int) -> int:
        """Grow the ring towards its full size; returns bytes copied."""
        target = self.capacity_for(n_tokens)
        if target == self.capacity:
            return 0
        # Below full size the ring has never wrapped: position p sits at column p.
        held = self.offset
        new_k = mx.zeros((1, self.shape.heads, target, self.shape.k_dim), dtype=self.shape.dtype)
        new_v = mx.zeros((1, self.shape.heads, target, self.shape.v_dim), dtype=self.shape.dtype)
        if held:
            new_k[..., :held, :] = self.keys[..., :held, :]
            new_v[..., :held, :] = self.values[..., :held, :]
        self.keys, self.values = new_k, new_v
        return held * self.shape.token_bytes()

    @property
    def held(self) -> int:
        """How many of the latest positions the ring holds."""
        return self.offset - self.oldest

    @property
    def needed(self) -> int:
        """How many of the latest positions going on from ``offset`` needs (what is saved): all it holds."""
        return self.held

    @property
    def nbytes(self) -> int:
        return self.capacity * self.shape.token_bytes()

    # -- the model's interface ---------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        if self.offset + n > self.capacity and self.capacity < self.max_capacity:
            raise RuntimeError(f"window capacity {self.capacity} reached at {self.offset + n} tokens: reserve() first")
        if n == 1:
            used = self.append_one(keys, values)
            return self.keys[..., :used, :], self.values[..., :used, :]
        before_k, before_v = self.recent(min(self.offset, self.window - 1))
        self._write(keys, values)
        return _joined(before_k, keys), _joined(before_v, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        window = window_size or self.window
        if n > 1:
            before = min(self.offset, self.window - 1)
            if before + n > window or return_array:
                return create_causal_mask(n, before, window_size=window)
            return "causal"
        capacity = self.capacity_for(self.offset + 1)
        if self.offset + 1 <= window or capacity == window:
            return None
        # The ring is longer than the window: hide the positions that fell out of it
        # (and the stale columns a trim left, which are older still).
        used = min(self.offset + 1, capacity)
        age = (self.offset - mx.arange(used)) % capacity
        return age < window

    # -- positions -----------------------------------------------------------------------
    def recent(self, n: int) -> tuple[mx.array | None, mx.array | None]:
        """Positions ``[offset - n, offset)`` in temporal order (``n <= held``)."""
        if n <= 0:
            return None, None
        start = (self.offset - n) % self.capacity
        if start + n <= self.capacity:
            return self.keys[..., start:start + n, :], self.values[..., start:start + n, :]
        split = self.capacity - start
        keys = mx.concatenate([self.keys[..., start:, :], self.keys[..., : n - split, :]], axis=2)
        values = mx.concatenate([self.values[..., start:, :], self.values[..., : n - split, :]], axis=2)
        return keys, values

    def append_one(self, keys: mx.array, values: mx.array) -> int:
        """A decode step's position, without the views :meth:`update_and_fetch` makes; returns how many
        leading columns of the ring attention reads (all it holds: one query's mask hides the stale ones)."""
        if self.offset + 1 > self.capacity and self.capacity < self.max_capacity:
            raise RuntimeError(f"window capacity {self.capacity} reached at {self.offset + 1} tokens: reserve() first")
        self._write(keys, values)
        return min(self.offset, self.capacity)

    def _write(self, keys: mx.array, values: mx.array) -> None:
        """Store new positions at their ring columns; only the last ``capacity`` of them survive."""
        n = keys.shape[2]
        keep = min(n, self.capacity)
        first = self.offset + n - keep
        keys, values = keys[..., n - keep:, :], values[..., n - keep:, :]
        column = first % self.capacity
        head = min(keep, self.capacity - column)
        self.keys[..., column:column + head, :] = keys[..., :head, :]
        self.values[..., column:column + head, :] = values[..., :head, :]
        if head < keep:
            self.keys[..., : keep - head, :] = keys[..., head:, :]
            self.values[..., : keep - head, :] = values[..., head:, :]
        self.offset += n
        self.oldest = max(self.oldest, self.offset - self.capacity)

    def columns(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Views of positions ``[start, end)`` (held ones, not across the ring's end: the disk tier cuts on
        block boundaries, and the ring's capacity is a whole number of blocks)."""
        column = start % self.capacity
        return self.keys[..., column:column + end - start, :], self.values[..., column:column + end - start, :]

    def load_from(self, start: int, keys: mx.array | None, values: mx.array | None) -> None:
        """An empty ring becomes positions ``[start, start + n)`` (room reserved by the caller)."""
        self.offset = self.oldest = start
        if keys is not None:
            self._write(keys, values)

    def shrink(self) -> int:
        """(A ring never holds more than its window: nothing to give back.)"""
        return 0

    def blank(self) -> "WindowKV":
        """An empty ring of the same kind."""
        return type(self)(self.shape, self.block_tokens, self.window)

    def reset(self) -> None:
        """Back to position 0, keeping the arrays (the next writes overwrite them)."""
        self.restore(WindowState(0, 0, self.keys, self.values))

    # -- checkpoints -------------------------------------------------------------------
    def state_now(self) -> WindowState:
        # ``a[...] = v`` rebinds the array object itself, so a checkpoint must not share the
        # ring's objects: ``[:]`` makes new ones over the same data (no copy until a write).
        return WindowState(self.offset, self.oldest, _own(self.keys), _own(self.values))

    def restore(self, state: WindowState) -> None:
        """Continue from a checkpoint; the ring's next write copies it, the checkpoint stays valid."""
        self.offset, self.oldest = state.offset, state.oldest
        self.keys, self.values = _own(state.keys), _own(state.values)

    def can_continue_from(self, n_tokens: int) -> bool:
        """Whether the ring as it is can serve a sequence cut back to ``n_tokens``."""
        if n_tokens == self.offset:
            return True
        if n_tokens > self.offset or n_tokens < 0:
            return False
        # The oldest position the next step needs is n_tokens - (window - 1).
        return max(0, n_tokens - self.window + 1) >= self.oldest

    def trim_to(self, n_tokens: int) -> None:
        """Forget positions from ``n_tokens`` on (``can_continue_from`` must hold)."""
        self.offset = n_tokens

    # -- speculative positions -------------------------------------------------------------
    def undo_for(self, n_tokens: int) -> "RingUndo":
        """What the next ``n_tokens`` writes will overwrite (the ring's oldest positions, once it is full), copied
        now: a speculative step that keeps fewer of them puts those columns back (:meth:`undo`)."""
        capacity = self.capacity_for(self.offset + n_tokens)
        columns = [(self.offset + j) % capacity for j in range(n_tokens)]
        if self.keys is None or capacity > self.capacity:
            return RingUndo(self.offset, self.oldest, columns, None, None)
        index = mx.array(columns)
        keys, values = mx.take(self.keys, index, axis=2), mx.take(self.values, index, axis=2)
        mx.eval(keys, values)  # (copies of their own before the ring's arrays are written)
        return RingUndo(self.offset, self.oldest, columns, keys, values)

    def undo(self, saved: "RingUndo", n_tokens: int) -> None:
        """Back to ``n_tokens`` positions after a speculative step's writes: the columns past them hold again
        what they held before the step."""
        if saved.keys is not None and saved.values is not None:
            for j in range(n_tokens - saved.offset, len(saved.columns)):
                column = saved.columns[j]
                self.keys[..., column:column + 1, :] = saved.keys[..., j:j + 1, :]
                self.values[..., column:column + 1, :] = saved.values[..., j:j + 1, :]
        self.offset, self.oldest = n_tokens, saved.oldest

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return self.keys, self.values, self.offset


def _own(array: mx.array | None) -> mx.array | None:
    return None if array is None else array[:]


def _joined(before: mx.array | None, new: mx.array) -> mx.array:
    return new if before is None else mx.concatenate([before, new], axis=2)
