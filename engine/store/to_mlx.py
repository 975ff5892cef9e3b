"""Turning a read cache record into MLX blocks: the engine-thread half of a restore.

The reader runs on the I/O thread and returns numpy views of the file's bytes
(bfloat16 as its uint16 bit pattern, since numpy has no bfloat16); this copies
them into MLX on the thread that owns MLX.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.runtime.kv_blocks import BlockData, eval_blocks

from .cache_file import CacheRecord

_AS_MLX: dict[str, Callable[[np.ndarray], mx.array]] = {
    "float32": mx.array,
    "float16": mx.array,
    "bfloat16": lambda bits: mx.array(bits).view(mx.bfloat16),
}


def to_mx_blocks(record: CacheRecord) -> dict[int, list[BlockData]]:
    """group index -> that group's blocks in position order, evaluated."""
    as_mlx = _AS_MLX[record.header.spec["dtype"]]
    by_group: dict[int, list[BlockData]] = {}
    for block in sorted(record.blocks, key=lambda b: (b.group, b.start)):
        data = BlockData(
            block.start,
            block.length,
            tuple(as_mlx(k) for k in block.keys),
            tuple(as_mlx(v) for v in block.values),
        )
        by_group.setdefault(block.group, []).append(data)
    eval_blocks([data for blocks in by_group.values() for data in blocks])
    return by_group
