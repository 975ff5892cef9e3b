"""A run of positions of one layer group's K/V, as MLX arrays: what a cache hands the disk tier and gets back.

The runtime cuts a resident cache into slices on block boundaries
(``SequenceKV.slices``); the store writes them (``cache_format.PersistedBlock``
is the same run as the file holds it) and reads them back as slices for the
runtime to install.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class LayerSlice:
    """Positions ``[start, start + length)`` of every layer of one group; ``checkpoint``: None for the cache's
    own positions, ``i`` for a run of its ``i``-th window checkpoint."""

    group: int
    start: int
    length: int
    keys: tuple[mx.array, ...]
    values: tuple[mx.array, ...]
    checkpoint: int | None = None
