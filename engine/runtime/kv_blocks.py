"""Moving KV tensors between the block store and mlx-lm cache objects.

The pool (engine.domain.block_pool) only counts block ids; this module owns
the arrays behind them. A block holds, for every layer of its layer group,
K and V of shape ``(1, kv_heads, n, head_dim)`` with ``n <= block_tokens``.

Building a cache for a turn concatenates an agent's blocks once per layer
(one copy, then the BatchGenerator merges it into the batch). After the turn
only the blocks past the last unchanged complete block are written, as
copies, so a block's memory is exactly its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engine.domain.block_layout import Run, Span
from engine.domain.cache_spec import LayerGroup, ModelCacheSpec


@dataclass(frozen=True, slots=True)
class BlockData:
    """Immutable tensors of one block: positions ``[start, start + length)``."""

    start: int
    length: int
    keys: tuple[mx.array, ...]  # one per layer of the group, in group order
    values: tuple[mx.array, ...]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


class BlockStore:
    """block id -> BlockData. Only the engine thread touches it."""

    def __init__(self) -> None:
        self._data: dict[int, BlockData] = {}

    def put(self, block_id: int, data: BlockData) -> None:
        self._data[block_id] = data

    def get(self, block_id: int) -> BlockData:
        return self._data[block_id]

    def discard(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            self._data.pop(block_id, None)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()


def build_prompt_cache(
    model: Any, spec: ModelCacheSpec, runs: dict[int, Run], store: BlockStore
) -> list[Any]:
    """A fresh per-layer mlx-lm cache holding exactly the positions in ``runs``."""
    caches = _template_caches(model)
    for group in spec.groups:
        run = runs.get(group.index, Run())
        if not run.refs:
            continue
        for slot, layer in enumerate(group.layers):
            keys, values = _gather(run, store, slot)
            _fill(caches[layer], keys, values, run.end)
    return caches


def _template_caches(model: Any) -> list[Any]:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def _gather(run: Run, store: BlockStore, slot: int) -> tuple[mx.array, mx.array]:
    keys, values = [], []
    for ref in run.refs:
        data = store.get(ref.block_id)
        k, v = data.keys[slot], data.values[slot]
        if ref.length < data.length:
            k, v = k[..., : ref.length, :], v[..., : ref.length, :]
        keys.append(k)
        values.append(v)
    if len(keys) == 1:
        return keys[0], values[0]
    return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)


def _fill(cache: Any, keys: mx.array, values: mx.array, n_tokens: int) -> None:
    if isinstance(cache, RotatingKVCache):
        # Positions are held in temporal order, so the write index is the end.
        cache.keys, cache.values = keys, values
        cache.offset = n_tokens
        cache._idx = keys.shape[2]
    elif isinstance(cache, KVCache):
        cache.keys, cache.values, cache.offset = keys, values, n_tokens
    else:
        raise TypeError(f"cannot fill cache of type {type(cache).__name__}")


def source_start(cache: Any, n_tokens: int) -> int:
    """First absolute position a finished sequence's layer cache still holds."""
    return n_tokens - held_tokens(cache)


def held_tokens(cache: Any) -> int:
    if cache.keys is None:
        return 0
    if isinstance(cache, RotatingKVCache):
        return min(cache.keys.shape[2], cache.offset)
    return cache.offset


def group_source_start(caches: list[Any], group: LayerGroup, n_tokens: int) -> int:
    return max(source_start(caches[layer], n_tokens) for layer in group.layers)


def cut_block(caches: list[Any], group: LayerGroup, span: Span, n_tokens: int) -> BlockData:
    """Copy positions ``span`` of every layer of ``group`` out of finished caches."""
    keys, values = [], []
    for layer in group.layers:
        cache = caches[layer]
        k, v = _ordered(cache)
        offset = n_tokens - k.shape[2]
        a, b = span.start - offset, span.end - offset
        keys.append(mx.contiguous(k[..., a:b, :]))
        values.append(mx.contiguous(v[..., a:b, :]))
    return BlockData(span.start, span.length, tuple(keys), tuple(values))


def _ordered(cache: Any) -> tuple[mx.array, mx.array]:
    """K and V of a finished single-sequence cache in temporal order, trimmed to what is valid."""
    if isinstance(cache, RotatingKVCache):
        held = held_tokens(cache)
        k = cache._temporal_order(cache.keys)[..., -held:, :]
        v = cache._temporal_order(cache.values)[..., -held:, :]
        return k, v
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


def eval_blocks(blocks: Sequence[BlockData]) -> None:
    arrays = [a for b in blocks for a in (*b.keys, *b.values)]
    if arrays:
        mx.eval(arrays)
