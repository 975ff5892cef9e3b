"""A layer that attends to another layer's K/V (Gemma 4's KV-shared layers), as a cache the model can hold.

mlx-lm's Gemma 4 keeps caches for its first layers only; each later layer
reuses the keys and values an earlier layer of its kind fetched, and attends
with no cache of its own. The engine's caches return less than everything a
row attends to (a batch's view hands back only the step's new keys; a cache
that starts with shared segments only its own tail), so a shared layer is
given this view of its source instead: it writes nothing, and attention runs
over the source's cache as the source's own attention does. It holds no
blocks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class SharedKV:
    """Layer ``j``'s view of the cache of the layer it shares K/V with (one sequence)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    @property
    def offset(self) -> int:
        return self.source.offset

    @property
    def attention(self) -> Any:
        return self.source.attention

    @property
    def prefix(self) -> list[tuple[mx.array, mx.array]]:
        return getattr(self.source, "prefix", [])

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.source.make_mask(*args, **kwargs)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """``keys``/``values`` are what the source fetched this pass: nothing to write."""
        return keys, values
