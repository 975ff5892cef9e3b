"""K/V quantized at rest: what an evicted agent's blocks become on disk under ``--kv-bits-at-rest``.

mlx-lm's ``BatchGenerator`` decodes only full-precision caches, so the engine
quantizes where it owns the bytes: blocks leaving the pool for the warm tier
(and the shared prefix files beside them). ``mx.quantize`` packs each K or V
along the head dimension in groups with a scale and a bias per group (in the
KV dtype); a restore dequantizes them back into the pool's dtype. 8 bits keep
the agent's greedy continuation close to the full-precision one; the
measurements are in bench/bench_kv_at_rest.py and its report.

Runs on the engine thread (it is MLX work): the I/O thread only writes bytes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.domain.cache_spec import ModelCacheSpec
from engine.store.cache_file import QUANTIZATION_GROUP_SIZES, KVQuantization, PersistedBlock, QuantizedArray
from engine.store.layer_slice import LayerSlice

log = logging.getLogger("semantic.store")

# Groups of 64 values share a scale and a bias: mlx-lm's default for weights and for its own
# quantized KV cache. Smaller head dims take the largest group size that divides them.
PREFERRED_GROUP_SIZE = 64


def quantization_for(bits: int | None, *head_dims: int) -> KVQuantization | None:
    """The quantization for ``bits`` on these head dims (every K and V width of the model); None for full
    precision, or when no group size ``mx.quantize`` offers divides them all (then the files stay full
    precision, logged)."""
    if bits is None:
        return None
    sizes = [PREFERRED_GROUP_SIZE, *sorted((g for g in QUANTIZATION_GROUP_SIZES if g != PREFERRED_GROUP_SIZE),
                                           reverse=True)]
    for group_size in sizes:
        if all(dim % group_size == 0 and dim * bits % 32 == 0 for dim in head_dims):
            return KVQuantization(bits, group_size)
    log.warning("kv_bits_at_rest %d: head dims %s split into no group size of %s; "
                "caches are stored at full precision", bits, "/".join(map(str, head_dims)), QUANTIZATION_GROUP_SIZES)
    return None


def hot_quantization(spec: ModelCacheSpec) -> KVQuantization | None:
    """How a hot pool of ``spec`` holds K/V (``--kv-bits``), in the terms of the files: its caches rest (in
    memory and on disk) as the pool holds them. None: full precision."""
    if spec.kv_bits is None or not spec.quantized_groups:
        return None
    holding = {g.index for g in spec.groups if not g.is_recurrent}
    groups = None if spec.quantized_groups == holding else tuple(sorted(spec.quantized_groups))
    return KVQuantization(spec.kv_bits, spec.kv_group_size, groups)


@dataclass(slots=True)
class CacheAtRest:
    """An agent's cache out of the pool: its tokens, its blocks (the cache's own, then its checkpoints'), and
    the checkpoints' header entries.

    ``quantization``: how the blocks are stored (None: full precision, the
    store quantizes them if its setting says so). ``prefix``: the shared
    prefix file its first tokens are left to (``{"key", "n_tokens"}``), whose
    full-attention blocks it then does not hold. The cool tier keeps one in
    memory (quantized); the warm tier writes one to disk.
    """

    tokens: list[int]
    blocks: tuple[PersistedBlock, ...]
    quantization: KVQuantization | None = None
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    prefix: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(block_nbytes(b) for b in self.blocks)

    def pool_blocks(self, block_bytes: int) -> int:
        """Whole pool blocks its bytes take."""
        return max(1, math.ceil(self.nbytes / block_bytes))

    def slices(self, pool: KVQuantization | None = None) -> list[LayerSlice]:
        """In the layout a restore installs: full precision, or packed as they are where the pool holds K/V
        quantized the same way (``pool``: the hot pool's quantization)."""
        if self.quantization is None or self.quantization == pool:
            return [as_slice(b) for b in self.blocks]
        return dequantized_slices(self.blocks, self.quantization)


def as_slice(block: PersistedBlock) -> LayerSlice:
    """A block of MLX arrays at full precision, as the slice a restore installs."""
    return LayerSlice(block.group, block.start, block.length, block.keys, block.values, block.checkpoint, block.states)


def as_block(piece: LayerSlice) -> PersistedBlock:
    """A slice of a resident cache as the block the disk tier writes."""
    return PersistedBlock(piece.group, piece.start, piece.length, piece.keys, piece.values, piece.checkpoint,
                          piece.states)


def quantize_blocks(blocks: tuple[PersistedBlock, ...], quantization: KVQuantization) -> tuple[PersistedBlock, ...]:
    """Every K and V of ``blocks`` quantized, evaluated (the I/O thread reads their bytes as they are).
    Recurrent states stay as they are: full precision at rest (a state carries a conversation's whole
    history in one matrix, and no measurement says quantizing it is safe)."""
    out = tuple(
        b if b.states or not quantization.covers(b.group) else
        PersistedBlock(b.group, b.start, b.length, tuple(quantized(k, quantization) for k in b.keys),
                       tuple(quantized(v, quantization) for v in b.values), b.checkpoint)
        for b in blocks
    )
    mx.eval([part for b in out for q in (*b.keys, *b.values) for part in q])
    return out


def dequantized(array: QuantizedArray, quantization: KVQuantization) -> mx.array:
    """A quantized K or V back in the dtype of its scales (the spec's KV dtype)."""
    return mx.dequantize(array.packed, array.scales, array.biases,
                         group_size=quantization.group_size, bits=quantization.bits)


def dequantized_slices(blocks: tuple[PersistedBlock, ...], quantization: KVQuantization) -> list[LayerSlice]:
    """Quantized blocks (MLX arrays) as the full-precision slices a restore installs."""
    return [as_slice(b) if b.states or not quantization.covers(b.group) else
            LayerSlice(b.group, b.start, b.length, tuple(dequantized(k, quantization) for k in b.keys),
                       tuple(dequantized(v, quantization) for v in b.values), b.checkpoint)
            for b in blocks]


def round_trip(array: mx.array, quantization: KVQuantization) -> mx.array:
    """A K or V as it comes back from the cool or warm tier: quantized, then dequantized."""
    return dequantized(quantized(array, quantization), quantization)


def block_nbytes(block: PersistedBlock) -> int:
    """The bytes a block's arrays hold (a quantized K or V counts its packed words, scales and biases)."""
    return sum(_nbytes(a) for a in block.arrays)


def quantized(array: mx.array | QuantizedArray, quantization: KVQuantization) -> QuantizedArray:
    """One K or V as the cool tier and the warm files hold it (not evaluated); one packed already (a hot pool
    that quantizes) as it is."""
    if isinstance(array, QuantizedArray):
        return array
    packed, scales, biases = mx.quantize(array, group_size=quantization.group_size, bits=quantization.bits)
    return QuantizedArray(packed, scales, biases)


def _nbytes(array: Any) -> int:
    if isinstance(array, QuantizedArray):
        return sum(int(part.nbytes) for part in array)
    return int(array.nbytes)
