"""Turning a read cache record into MLX blocks: the engine-thread half of a restore.

The reader runs on the I/O thread and returns numpy views of the file's bytes
(bfloat16 as its uint16 bit pattern, since numpy has no bfloat16); this copies
them into MLX on the thread that owns MLX.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.store.layer_slice import LayerSlice

from engine.store.cache_file import CacheRecord
from engine.store.cache_file import KVQuantization, PersistedBlock, QuantizedArray
from engine.store.kv_at_rest import dequantized

_AS_MLX: dict[str, Callable[[np.ndarray], mx.array]] = {
    "float32": mx.array,
    "float16": mx.array,
    "bfloat16": lambda bits: mx.array(bits).view(mx.bfloat16),
}


def to_mx_slices(record: CacheRecord, pool: KVQuantization | None = None) -> list[LayerSlice]:
    """The record's blocks as MLX arrays in file order, evaluated.

    The cache's own blocks come first (by group, then position), then each
    checkpoint's, with ``checkpoint`` set to its index in the header. Quantized
    K/V come back at full precision, or packed as they are where the pool holds
    them quantized the same way (``pool``: the hot pool's quantization).
    """
    as_mlx = _AS_MLX[record.header.spec["dtype"]]
    quantization = record.header.quantization

    def array(stored: np.ndarray | QuantizedArray) -> mx.array | QuantizedArray:
        if isinstance(stored, QuantizedArray):
            assert quantization is not None
            packed = QuantizedArray(mx.array(stored.packed), as_mlx(stored.scales), as_mlx(stored.biases))
            return packed if quantization == pool else dequantized(packed, quantization)
        return as_mlx(stored)

    def states(block: PersistedBlock) -> tuple[tuple[mx.array, ...], ...]:
        # Each state array in its own dtype, as the spec lists them (a recurrent matrix is often float32
        # beside bfloat16 K/V).
        dtypes = _state_dtypes(record, block.group) if block.states else []
        return tuple(tuple(_AS_MLX[dtype](a) for a, dtype in zip(state, dtypes)) for state in block.states)

    slices = [
        LayerSlice(block.group, block.start, block.length,
                   tuple(array(k) for k in block.keys), tuple(array(v) for v in block.values),
                   block.checkpoint, states(block))
        for block in sorted(record.blocks, key=lambda b: b.file_order)
    ]
    mx.eval([a for s in slices for a in s.arrays])
    return slices


def _state_dtypes(record: CacheRecord, group: int) -> list[str]:
    """The dtypes of a recurrent group's state arrays, as the header's spec lists them."""
    entry = next(g for g in record.header.spec["groups"] if g["index"] == group)
    return [dtype for _, dtype in entry["state"]["arrays"]]

