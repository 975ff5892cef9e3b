"""One layer of a batch whose model computes with the K/V it fetched: each row's K/V, padded to the longest.

Latent attention in mlx-lm's absorbed form (DeepSeek V3, GLM-4.7-Flash, Kimi
K2.5, Mistral 4) does more with what ``update_and_fetch`` returns than pass it
on to attention: it scores its queries' rotary half against the fetched rotary
keys itself (``pe_scores``, handed to attention as an additive mask) and, for
a prompt chunk, expands the fetched latents into per-head keys and values. The
ragged view (``ragged.py``) returns only the pass's new K/V, which is all an
ordinary attention module needs; here the model must get every position of
every row. So this view fetches each row's K/V from its own cache and hands
the model one batch of them, padded on the right to the longest row, with a
mask that hides each row's padding (and the future, per row, at its own
offset). mlx-lm's ``BatchKVCache`` does the same with left padding, but keeps
the padded batch as the cache; here the rows' own caches stay the cache and
the padded batch lives for one pass.

Attention itself still runs a row at a time on that row's part of the
arrays the model hands it, by the row cache's own arithmetic: the same shapes
as the row alone, so the tokens are the row's alone. Where the model attends
to the fetched latents as they are (a decode step: keys and values are the
latents), the row's own fetched view is used and the padded copy of the
latents is never computed (MLX evaluates lazily); only the narrow rotary keys
the model scores against are copied.

A sequence of such a model never shares prefix segments by reference (the
engine copies shared prefixes for it: ``HotCache(share_by_reference=False)``),
so position ``j`` of a row's fetched K/V is its position ``j``.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx


class PaddedLayerCache:
    """One layer's view of a batch for a model that reads the fetched K/V: row ``b`` is sequence ``b``'s cache."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self.rows = rows
        self.offset = mx.array([row.offset for row in rows])
        self._starts = [row.offset for row in rows]
        # This pass's fetched views per row, the padded arrays handed to the model, and each row's length.
        self._fetched: list[tuple[mx.array, mx.array]] = []
        self._padded: tuple[mx.array, mx.array] | None = None
        self._lengths: list[int] = []

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(rows, 1, n, longest): query ``i`` of row ``b`` (position ``start_b + i``) sees keys up to its own
        position; the padding after a row's end is past every query of that row, so it is hidden too."""
        starts = mx.array(self._starts)[:, None, None]
        queries = starts + mx.arange(n)[None, :, None]
        keys = mx.arange(max(self._starts) + n)[None, None, :]
        mask = keys <= queries
        if window_size is not None:
            mask = mask & (keys > queries - window_size)
        return mx.expand_dims(mask, 1)

    def padding_mask(self) -> mx.array:
        """(rows, 1, 1, longest): the positions each row's fetch holds (after :meth:`update_and_fetch`)."""
        return (mx.arange(max(self._lengths))[None, :] < mx.array(self._lengths)[:, None])[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._fetched = [row.update_and_fetch(keys[b:b + 1], values[b:b + 1]) for b, row in enumerate(self.rows)]
        self._lengths = [k.shape[2] for k, _ in self._fetched]
        longest = max(self._lengths)
        self._padded = (_padded([k for k, _ in self._fetched], longest), _padded([v for _, v in self._fetched], longest))
        return self._padded

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
               sinks: Any = None) -> mx.array:
        """Each row's attention over its own positions of ``keys``/``values`` (arrays the model made from the
        padded fetch, or that fetch itself), with its part of ``mask``."""
        outputs = []
        for b, row in enumerate(self.rows):
            n = self._lengths[b]
            k, v = self._row_part(keys, b, n), self._row_part(values, b, n)
            outputs.append(row.attention.sdpa(queries[b:b + 1], k, v, scale, _row_mask(mask, b, n), sinks))
        return mx.concatenate(outputs, axis=0)

    def _row_part(self, array: mx.array, b: int, n: int) -> mx.array:
        """Row ``b``'s ``n`` positions of ``array``: its own fetched view where ``array`` is the padded fetch."""
        assert self._padded is not None
        for i, padded in enumerate(self._padded):
            if array is padded:
                return self._fetched[b][i]
        return array[b:b + 1, :, :n]


def _padded(arrays: list[mx.array], length: int) -> mx.array:
    """Rows (1, heads, n_b, dim) as one (rows, heads, ``length``, dim), zeros after each row's end."""
    return mx.concatenate([
        a if a.shape[2] == length else mx.pad(a, [(0, 0), (0, 0), (0, length - a.shape[2]), (0, 0)])
        for a in arrays
    ], axis=0)


def _row_mask(mask: Any, b: int, n: int) -> Any:
    """Row ``b``'s part of a batch's mask over its ``n`` keys (a string or None applies to every row)."""
    if not isinstance(mask, mx.array):
        return mask
    if mask.ndim == 4 and mask.shape[0] > 1:
        mask = mask[b:b + 1]
    return mask[..., :n]
