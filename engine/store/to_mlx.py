"""Turning a read cache record into MLX blocks: the engine-thread half of a restore.

The reader runs on the I/O thread and returns numpy views of the file's bytes
(bfloat16 as its uint16 bit pattern, since numpy has no bfloat16); this copies
them into MLX on the thread that owns MLX.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.runtime.kv.sequence_kv import LayerSlice

from .cache_file import CacheRecord

_AS_MLX: dict[str, Callable[[np.ndarray], mx.array]] = {
    "float32": mx.array,
    "float16": mx.array,
    "bfloat16": lambda bits: mx.array(bits).view(mx.bfloat16),
}


def to_mx_slices(record: CacheRecord) -> list[LayerSlice]:
    """The record's blocks as MLX arrays in file order, evaluated.

    The cache's own blocks come first (by group, then position), then each
    checkpoint's, with ``checkpoint`` set to its index in the header.
    """
    as_mlx = _AS_MLX[record.header.spec["dtype"]]
    slices = [
        LayerSlice(block.group, block.start, block.length,
                   tuple(as_mlx(k) for k in block.keys), tuple(as_mlx(v) for v in block.values),
                   block.checkpoint)
        for block in sorted(record.blocks, key=lambda b: b.file_order)
    ]
    mx.eval([a for s in slices for a in (*s.keys, *s.values)])
    return slices
