"""Running many sequences in one forward pass, each attending to its own resident cache.

Decode steps feed one token per sequence; prefill feeds equal-length prompt
chunks of several sequences at once.

The model's projections and MLP run on the whole batch; attention runs per
sequence on that sequence's own layer cache, so a sequence joins or leaves
the batch without any cache being copied (mlx-lm's ``BatchKVCache`` instead
merges every joining cache into padded batch tensors and extracts them back).

The hook: mlx-lm's attention modules call the ``scaled_dot_product_attention``
their module imported from ``mlx_lm.models.base``. :func:`install` replaces
that name in the model's modules with a function that hands a
:class:`RaggedLayerCache` its per-row attention and calls the original for
anything else, so other users of those modules are unaffected. A model whose
attention does not go through that function cannot be batched this way;
the engine then decodes its sequences one at a time, and shares prefixes by
copying them instead of by reference. A model that computes with the K/V it
fetches (latent attention) is batched through padded views instead
(``padded.py``), whose attention goes through the same hook.

The same hook serves caches that begin with shared segments (``segment.py``):
their attention runs over the segments and the sequence's own keys. Every
engine layer cache says how it attends (``attention.py``); a compute backend
may hand the batch its own subclass of :class:`RaggedLayerCache` (the CPU's
writes a decode step's keys in place and attends in compiled loops).

Why a patch of mlx-lm's module namespace: its attention modules call that
function by name, with the cache object, and offer no other seam through which
a row can attend to its own resident cache. The hook is installed once per
model module, is inert for every cache that is not the engine's, and leaves
when the last engine using it detaches its model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from engine.runtime.runner.kv.chunked_kv import ChunkedKV
from engine.runtime.runner.kv.full_kv import FullKV
from engine.runtime.runner.kv.padded import PaddedLayerCache
from engine.runtime.runner.kv.segment import segmented_attention
from engine.runtime.runner.kv.shared_kv import SharedKV
from engine.runtime.runner.kv.window_kv import WindowKV

SDPA_NAME = "scaled_dot_product_attention"


@dataclass(frozen=True, slots=True)
class RowMasks:
    """Per-row attention masks of one decode step (None: attend to every key the row holds)."""

    masks: tuple[Any, ...]


class RaggedLayerCache:
    """One layer's view of a batch: row ``b`` is sequence ``b``'s own cache for this layer."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self.rows = rows
        self.offset = mx.array([row.offset for row in rows])
        # This pass's K/V per row: a prefill chunk's fetched views, or for a decode step how many leading
        # positions of each row's arrays attention reads. Kept for the pass (a layer sharing this one's K/V
        # attends after it: ``shared``); the views go with this object when the pass ends.
        self._fetched: list[tuple[mx.array, mx.array]] = []
        self._held: list[int] = []

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> RowMasks:
        # n > 1: prompt chunks of one length, each row at its own offset (batched prefill).
        return RowMasks(tuple(row.make_mask(n, return_array=return_array, window_size=window_size) for row in self.rows))

    def maybe_trim_front(self) -> None:
        """Llama 4's call on its chunked layers' caches at the start of a pass: each row's fetch starts at its own
        chunk's reach."""
        for row in self.rows:
            row.maybe_trim_front()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._fetched, self._held = [], []
        # (A chunked layer's run of columns begins at its chunk's reach, not at column 0: its rows fetch views.)
        if keys.shape[2] == 1 and not isinstance(self.rows[0], ChunkedKV):
            self._decode_positions(keys, values)
        else:
            self._fetched = [row.update_and_fetch(keys[b:b + 1], values[b:b + 1]) for b, row in enumerate(self.rows)]
        # What attention needs is in self._fetched or the rows; the model only passes these on to the hook.
        return keys, values

    def _decode_positions(self, keys: mx.array, values: mx.array) -> None:
        """A decode step's positions, written into each row's arrays; the views attention needs are made
        where it runs."""
        self._held = [row.append_one(keys[b:b + 1], values[b:b + 1]) for b, row in enumerate(self.rows)]

    def attend(self, queries: mx.array, scale: float, mask: Any, sinks: Any = None) -> mx.array:
        return self._attend_rows(queries, scale, _row_masks(mask, len(self.rows)), sinks)

    def _attend_rows(self, queries: mx.array, scale: float, masks: Sequence[Any], sinks: Any) -> mx.array:
        """Each row's attention by its own cache's arithmetic, one call a row."""
        fetched = self._fetched or [row.held(n) if isinstance(row, FullKV) else (row.keys[..., :n, :], row.values[..., :n, :])
                                    for row, n in zip(self.rows, self._held)]
        outputs = [
            attention(queries[b:b + 1], k, v, row, scale, m, sinks)
            for b, ((k, v), m, row) in enumerate(zip(fetched, masks, self.rows))
        ]
        return mx.concatenate(outputs, axis=0)

    def shared(self) -> "SharedRows":
        """The view a layer that attends to this layer's K/V (Gemma 4's KV sharing) is given."""
        return SharedRows(self)


class SharedRows:
    """A KV-shared layer's view of a batch's layer: it writes nothing and attends as that layer does."""

    def __init__(self, source: RaggedLayerCache) -> None:
        self.source = source
        self.offset = source.offset

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.source.make_mask(*args, **kwargs)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any, sinks: Any = None) -> mx.array:
        return self.source.attend(queries, scale, mask, sinks)  # (attention may run again over a pass's K/V)


def _row_masks(mask: Any, rows: int) -> Sequence[Any]:
    """Per-row masks of a batch (None each where the model passed none)."""
    return mask.masks if isinstance(mask, RowMasks) else (None,) * rows


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
              sinks: Any = None) -> mx.array:
    """One sequence's attention by its cache's arithmetic: over shared segments and its own keys when it has
    segments."""
    kernels = cache.attention
    prefix = cache.prefix if isinstance(cache, (FullKV, SharedKV)) else None
    if not prefix:
        return kernels.sdpa(queries, keys, values, scale, mask, sinks)
    if sinks is not None:
        if isinstance(cache, FullKV):  # (its own positions joined to its segments', packed or not)
            keys, values = cache.positions(0, cache.offset)
        else:
            keys = mx.concatenate([k for k, _ in prefix] + [keys], axis=2)
            values = mx.concatenate([v for _, v in prefix] + [values], axis=2)
        return kernels.sdpa(queries, keys, values, scale, mask, sinks)
    return segmented_attention(queries, [*prefix, (keys, values)], scale, mask, kernels)


def install(model: Any) -> bool:
    """Route the model's attention through the ragged hook; False when it cannot be. Pair with
    :func:`uninstall`."""
    hooked = False
    for module in _model_modules(model):
        current = getattr(module, SDPA_NAME, None)
        if current is None:
            continue
        if isinstance(current, _RaggedHook):
            current.users += 1
        else:
            setattr(module, SDPA_NAME, _RaggedHook(current))
        hooked = True
    return hooked


def uninstall(model: Any) -> None:
    """One user of the model's hooks is done; the last puts mlx-lm's function back."""
    for module in _model_modules(model):
        current = getattr(module, SDPA_NAME, None)
        if isinstance(current, _RaggedHook):
            current.users -= 1
            if current.users <= 0:
                setattr(module, SDPA_NAME, current.__wrapped__)


def _model_modules(model: Any) -> list[Any]:
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return [sys.modules[name] for name in sorted(names) if name in sys.modules]


class _RaggedHook:
    """mlx-lm's ``scaled_dot_product_attention`` for its own caches; the engine's caches attend their own way."""

    def __init__(self, original: Any) -> None:
        self.__wrapped__ = original
        self.users = 1

    def __call__(self, queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, (RaggedLayerCache, SharedRows)):
            return cache.attend(queries, scale, mask, sinks)
        if isinstance(cache, PaddedLayerCache):
            return cache.attend(queries, keys, values, scale, mask, sinks)
        if isinstance(cache, (FullKV, WindowKV, ChunkedKV, SharedKV)):
            return attention(queries, keys, values, cache, scale, mask, sinks)
        if sinks is None:
            return self.__wrapped__(queries, keys, values, cache=cache, scale=scale, mask=mask)
        return self.__wrapped__(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
