"""Chunked-window K/V of one sequence (Llama 4's local layers): the current chunk, in one run of blocks.

A chunked layer with chunk C attends, at position p, to the positions of its
own chunk, ``[p // C * C, p]``. mlx-lm's ``ChunkedKVCache`` keeps the last C
positions (``start_position``), and Llama 4 builds its chunk mask from the
first layer's ``start_position`` and ``offset``: keys it fetches before the
chunk boundary are masked out, and contribute exactly nothing to a softmax.
So fetching from any start at or before the chunk boundary gives the same
result; this cache fetches from ``max(oldest, offset - C)``, which is.

Unlike a sliding window's ring, the model needs the keys in order (its mask
indexes them by position), so they lie in one run of columns: column
``p - base``, ``base`` a block boundary. When the run needs room, the columns
before the block holding the next fetch's start are dropped (the rest is
copied down: about C positions every block of tokens). What a chunked layer
forgets cannot be recomputed without a prefill, so, as for sliding windows,
the engine keeps checkpoints of it (:class:`ChunkState`).

A checkpoint costs nothing while the run still holds its chunk: the columns
before ``offset`` never change (writes go at ``offset`` on; a cut back drops
the checkpoints past it), so it shares the run's arrays. Only before a
relayout drops columns does it get a copy of its own chunk so far
(:meth:`ChunkedKV.compact`, called by the sequence that holds both).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from engine.runtime.runner.kv.attention import MLX_ATTENTION, Attention
from engine.runtime.runner.kv.full_kv import KVShape, _round_up


@dataclass(frozen=True, slots=True)
class ChunkState:
    """A chunked layer at ``offset`` tokens: its run of columns from ``base``, valid from ``oldest``."""

    offset: int
    oldest: int
    base: int
    keys: mx.array | None
    values: mx.array | None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


class ChunkedKV(_BaseCache):
    # How a sequence on this cache attends (a backend's cache kinds may bring their own: kinds.py).
    attention: Attention = MLX_ATTENTION

    def __init__(self, shape: KVShape, block_tokens: int, chunk: int) -> None:
        self.shape = shape
        self.block_tokens = block_tokens
        self.chunk = chunk
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.oldest = 0  # positions before it are gone
        self.base = 0  # the position of column 0 (a block boundary)
        self.start = 0  # where this pass's fetches begin (mlx-lm's start_position)

    # -- what the model reads -----------------------------------------------------------
    @property
    def start_position(self) -> int:
        return self.start

    def maybe_trim_front(self) -> None:
        """The model's call at the start of a forward pass: fetches begin at the chunk's reach."""
        self.start = max(self.oldest, self.offset - self.chunk)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._write(keys, values)
        first, end = self.start - self.base, self.offset - self.base
        return self.keys[..., first:end, :], self.values[..., first:end, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """The chunk mask of the next ``n`` positions over what this pass fetches (from ``start``), as Llama 4
        builds it from the first layer's cache: a query sees the keys of its own chunk up to itself. Llama 4
        alone builds it itself; a batch of rows asks each row for its own (``llama4_rows.py``)."""
        keys = mx.arange(self.start, self.offset + n)[None, :]
        queries = mx.arange(self.offset, self.offset + n)[:, None]
        return (keys <= queries) & (keys // self.chunk == queries // self.chunk)

    # -- capacity ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def will_relay(self, n_tokens: int) -> bool:
        """Whether :meth:`reserve` of ``n_tokens`` lays the run out anew (dropping columns)."""
        return n_tokens > self.base + self.capacity

    def capacity_for(self, n_tokens: int) -> int:
        """Columns after a :meth:`reserve` of ``n_tokens``: as now when they fit, else the run from the next
        fetch's block to ``n_tokens`` and one spare block (so the copy down happens once a block of tokens).

        A prompt is reserved whole before it is prefilled (as for full attention);
        :meth:`shrink`, after the turn, gives back what the chunk no longer needs."""
        if n_tokens <= self.base + self.capacity:
            return self.capacity
        return _round_up(n_tokens - self._next_base(), self.block_tokens) + self.block_tokens

    def reserve(self, n_tokens: int) -> int:
        """Room for positions up to ``n_tokens``: drop the columns before the next fetch's block and grow;
        returns bytes copied."""
        if n_tokens <= self.base + self.capacity:
            return 0
        # (The new run may be as long as the old one: it starts further on.)
        return self._relaid(self.capacity_for(n_tokens))

    def shrink(self) -> int:
        """Keep only the run the next fetch needs, and a spare block; returns bytes copied."""
        return self._relaid(self.shrunk_columns()) if self.would_shrink() else 0

    def would_shrink(self) -> bool:
        return self.shrunk_columns() < self.capacity

    def shrunk_columns(self) -> int:
        """The run's columns after :meth:`shrink`."""
        return _round_up(self.offset - self._next_base(), self.block_tokens) + self.block_tokens

    def _relaid(self, target: int) -> int:
        """New columns of ``target`` positions from the next fetch's block on, holding what was there."""
        base = self._next_base()
        held = self.offset - base
        new_k = mx.zeros((1, self.shape.heads, target, self.shape.k_dim), dtype=self.shape.dtype)
        new_v = mx.zeros((1, self.shape.heads, target, self.shape.v_dim), dtype=self.shape.dtype)
        if held > 0 and self.keys is not None:
            first = base - self.base
            new_k[..., :held, :] = self.keys[..., first:first + held, :]
            new_v[..., :held, :] = self.values[..., first:first + held, :]
        self.keys, self.values, self.base = new_k, new_v, base
        self.oldest = max(self.oldest, base)
        return max(0, held) * self.shape.token_bytes()

    def _next_base(self) -> int:
        # A block boundary, unless the run starts later (a checkpoint's copy starts at its chunk boundary).
        reach = max(self.oldest, self.offset - self.chunk)
        return max(reach // self.block_tokens * self.block_tokens, self.base)

    @property
    def held(self) -> int:
        """How many of the latest positions the run holds."""
        return self.offset - self.oldest

    @property
    def needed(self) -> int:
        """How many of the latest positions going on from ``offset`` needs (what is saved): the current
        chunk's, from its boundary (the run may hold more: a prompt is reserved whole)."""
        return self.offset - max(self.oldest, self.offset // self.chunk * self.chunk)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.shape.token_bytes()

    # -- positions -----------------------------------------------------------------------
    def recent(self, n: int) -> tuple[mx.array | None, mx.array | None]:
        """Positions ``[offset - n, offset)`` (``n <= held``)."""
        if n <= 0:
            return None, None
        first = self.offset - n - self.base
        return self.keys[..., first:first + n, :], self.values[..., first:first + n, :]

    def columns(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Views of positions ``[start, end)`` (held ones)."""
        return (self.keys[..., start - self.base:end - self.base, :],
                self.values[..., start - self.base:end - self.base, :])

    def load_from(self, start: int, keys: mx.array | None, values: mx.array | None) -> None:
        """An empty layer becomes positions ``[start, start + n)`` (room for them reserved by the caller, from
        column 0 on)."""
        self.offset = self.oldest = self.start = start
        if keys is not None:
            self._write(keys, values)

    def _write(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        first = self.offset - self.base
        if first + n > self.capacity:
            raise RuntimeError(f"chunked capacity {self.base + self.capacity} reached at {self.offset + n} "
                               "tokens: reserve() first")
        self.keys[..., first:first + n, :] = keys
        self.values[..., first:first + n, :] = values
        self.offset += n

    def blank(self) -> "ChunkedKV":
        """An empty run of the same kind."""
        return type(self)(self.shape, self.block_tokens, self.chunk)

    def reset(self) -> None:
        """Back to position 0, keeping the arrays (the next writes overwrite them)."""
        self.offset = self.oldest = self.base = self.start = 0

    # -- checkpoints -------------------------------------------------------------------
    def state_now(self) -> ChunkState:
        """A checkpoint sharing the run's arrays (see the module's docstring)."""
        return ChunkState(self.offset, self.oldest, self.base, self.keys, self.values)

    def shares(self, state: ChunkState) -> bool:
        """Whether ``state`` lies in this run's arrays (costs nothing of its own)."""
        return state.keys is not None and state.keys is self.keys

    def compact_columns(self, state: ChunkState) -> int:
        """Columns :meth:`compact` gives ``state``: its chunk so far, in whole blocks."""
        return _round_up(state.offset - _chunk_start(state, self.chunk), self.block_tokens)

    def compact(self, state: ChunkState) -> ChunkState:
        """``state`` with arrays of its own holding only its chunk so far (nothing at a chunk boundary)."""
        start = _chunk_start(state, self.chunk)
        columns = self.compact_columns(state)
        if columns == 0:
            return ChunkState(state.offset, start, start, None, None)
        keys = mx.zeros((1, self.shape.heads, columns, self.shape.k_dim), dtype=self.shape.dtype)
        values = mx.zeros((1, self.shape.heads, columns, self.shape.v_dim), dtype=self.shape.dtype)
        first, n = start - state.base, state.offset - start
        keys[..., :n, :] = state.keys[..., first:first + n, :]
        values[..., :n, :] = state.values[..., first:first + n, :]
        mx.eval(keys, values)
        return ChunkState(state.offset, start, start, keys, values)

    def restore(self, state: ChunkState) -> None:
        """Continue from a checkpoint (which then shares the run's arrays, and stays valid)."""
        self.offset, self.oldest, self.base = state.offset, state.oldest, state.base
        self.start = max(self.oldest, self.offset - self.chunk)
        self.keys, self.values = state.keys, state.values

    def can_continue_from(self, n_tokens: int) -> bool:
        """Whether the run as it is can serve a sequence cut back to ``n_tokens``: it holds ``n_tokens``'
        chunk from its boundary on."""
        if n_tokens == self.offset:
            return True
        if n_tokens > self.offset or n_tokens < 0:
            return False
        return n_tokens // self.chunk * self.chunk >= self.oldest

    def trim_to(self, n_tokens: int) -> None:
        """Forget positions from ``n_tokens`` on (``can_continue_from`` must hold)."""
        self.offset = n_tokens
        self.start = max(self.oldest, n_tokens - self.chunk)

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return self.keys, self.values, self.offset


def _chunk_start(state: ChunkState, chunk: int) -> int:
    """The first position ``state``'s next token attends to: its chunk's boundary (or what it still holds)."""
    return max(state.oldest, state.offset // chunk * chunk)
