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
copying them instead of by reference.

The same hook serves caches that begin with shared segments (``segment.py``):
their attention runs over the segments and the sequence's own keys.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from engine.runtime import cpu_math

from . import host_decode
from .segment import segmented_attention

SDPA_NAME = "scaled_dot_product_attention"
_HOOKED = "_semantic_ragged"


@dataclass(frozen=True, slots=True)
class RowMasks:
    """Per-row attention masks of one decode step (None: attend to every key the row holds)."""

    masks: tuple[Any, ...]


class RaggedLayerCache:
    """One layer's view of a decode batch: row ``b`` is sequence ``b``'s own cache for this layer."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self.rows = rows
        self.offset = mx.array([row.offset for row in rows])
        self._fetched: list[tuple[mx.array, mx.array]] = []
        self._held: list[int] = []  # a decode step: how many leading positions of each row's arrays it reads
        # A decode step's new keys and values, and per row the own position host_decode writes them to
        # (None: written already, through MLX); empty when no row claimed one.
        self._new: tuple[mx.array, mx.array] | None = None
        self._claimed: list[int | None] = []

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> RowMasks:
        # n > 1: prompt chunks of one length, each row at its own offset (batched prefill).
        return RowMasks(tuple(row.make_mask(n, return_array=return_array, window_size=window_size) for row in self.rows))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] == 1:
            self._decode_positions(keys, values)
        else:
            self._fetched = [row.update_and_fetch(keys[b:b + 1], values[b:b + 1]) for b, row in enumerate(self.rows)]
        # What attention needs is in self._fetched or the rows; the model only passes these on to the hook.
        return keys, values

    def _decode_positions(self, keys: mx.array, values: mx.array) -> None:
        """A decode step's positions: claimed for host_decode to write in place where it will run and the
        row allows it (``FullKV.claim_one``), else written now through MLX (two slice updates a row and
        layer, ~2,000 small operations a step at 16 rows x 30 layers). The views attention may need are
        made where it runs."""
        claim = cpu_math.routed() and host_decode.may_write(keys, len(self.rows))
        held: list[int] = []
        claimed: list[int | None] = []
        for b, row in enumerate(self.rows):
            at = row.claim_one() if claim and hasattr(row, "claim_one") else None
            held.append(at + 1 if at is not None else row.append_one(keys[b:b + 1], values[b:b + 1]))
            claimed.append(at)
        self._held = held
        self._new, self._claimed = ((keys, values), claimed) if any(a is not None for a in claimed) else (None, [])

    def attend(self, queries: mx.array, scale: float, mask: Any, sinks: Any = None) -> mx.array:
        masks = mask.masks if isinstance(mask, RowMasks) else (None,) * len(self.rows)
        held, self._held = self._held, []
        new, claimed, self._new, self._claimed = self._new, self._claimed, None, []
        if held and cpu_math.routed():
            parts = [host_parts(row, n) for row, n in zip(self.rows, held)]
            if host_decode.applies(queries, parts, masks, sinks):
                return host_decode.attend(queries, parts, scale, masks, (*new, claimed) if new else None)
        if new is not None:  # claimed, but attention runs in MLX after all: write those positions through it
            for b, at in enumerate(claimed):
                if at is not None:
                    self.rows[b].write_claimed(at, new[0][b:b + 1], new[1][b:b + 1])
        fetched = self._fetched or [(row.keys[..., :n, :], row.values[..., :n, :]) for row, n in zip(self.rows, held)]
        outputs = [
            attention(queries[b:b + 1], k, v, row, scale, m, sinks)
            for b, ((k, v), m, row) in enumerate(zip(fetched, masks, self.rows))
        ]
        self._fetched = []  # the views pin the rows' arrays; a write in place needs them gone
        del fetched
        return mx.concatenate(outputs, axis=0)


def host_parts(row: Any, held: int) -> list[host_decode.PartArrays]:
    """A row's parts for host_decode: its shared segments, then the first ``held`` positions of its own arrays."""
    segments = [(k, v, k.shape[2]) for k, v in (getattr(row, "prefix", None) or ())]
    return [*segments, (row.keys, row.values, held)]


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
              sinks: Any = None) -> mx.array:
    """One sequence's attention: over shared segments and its own keys when it has segments."""
    prefix = getattr(cache, "prefix", None)
    if not prefix:
        return sdpa(queries, keys, values, scale, mask, sinks)
    if sinks is not None:
        keys = mx.concatenate([k for k, _ in prefix] + [keys], axis=2)
        values = mx.concatenate([v for _, v in prefix] + [values], axis=2)
        return sdpa(queries, keys, values, scale, mask, sinks)
    return segmented_attention(queries, [*prefix, (keys, values)], scale, mask)


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, sinks: Any = None) -> mx.array:
    """MLX's fused attention, or on the CPU the faster softmax of ``cpu_math`` where it is faster."""
    if sinks is None and cpu_math.routed():
        return cpu_math.attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def install(model: Any) -> bool:
    """Route the model's attention through the ragged hook; False when it cannot be."""
    modules = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    hooked = False
    for name in modules:
        module = sys.modules.get(name)
        original = getattr(module, SDPA_NAME, None)
        if original is None:
            continue
        if not getattr(original, _HOOKED, False):
            setattr(module, SDPA_NAME, _hooked(original))
        hooked = True
    return hooked


def _hooked(original: Any) -> Any:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, RaggedLayerCache):
            return cache.attend(queries, scale, mask, sinks)
        if getattr(cache, "prefix", None):
            return attention(queries, keys, values, cache, scale, mask, sinks)
        if cpu_math.routed() and not hasattr(cache, "bits"):  # (quantized caches: mlx-lm's own path)
            return sdpa(queries, keys, values, scale, mask, sinks)
        if sinks is None:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _HOOKED, True)
    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention
