"""The cool tier: an idle agent's cache quantized in memory, between hot (the pool) and warm (disk).

mlx-lm's ``BatchGenerator`` decodes only full-precision caches, so an agent
is quantized only while it waits: when the pool needs room, the least
recently used idle agent's K/V go through ``mx.quantize`` (--kv-bits-at-rest)
and its full-precision arrays are freed. The quantized copy stays in memory
and is paid for in pool blocks by its real bytes (rounded up to whole
blocks), so at 8 bits a float32 agent frees about 7 of every 10 blocks it held
and comes back with a dequantize instead of a disk read or a prefill.

A cool agent that must go further is written to disk as it is (its blocks are
already what a quantized warm file holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.store.cache_format import KVQuantization, PersistedBlock
from engine.store.kv_at_rest import block_nbytes, dequantized_slices, quantize_blocks, resident_blocks

from .agents import AgentRecord
from .kv.sequence_kv import LayerSlice


@dataclass(slots=True)
class CoolCache:
    tokens: list[int]
    blocks: tuple[PersistedBlock, ...]  # K/V as QuantizedArrays: the cache's own blocks, then checkpoints'
    quantization: KVQuantization
    checkpoints: list[dict[str, Any]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(block_nbytes(b) for b in self.blocks)

    def pool_blocks(self, block_bytes: int) -> int:
        """Whole pool blocks its bytes take."""
        return max(1, math.ceil(self.nbytes / block_bytes))

    def slices(self) -> list[LayerSlice]:
        """Dequantized, in the layout a restore installs (the warm tier's ``Loaded.slices``)."""
        return dequantized_slices(self.blocks, self.quantization)


def cool_copy(agent: AgentRecord, quantization: KVQuantization) -> CoolCache:
    """The agent's hot cache (shared prefix segments included, checkpoints too) quantized. Engine thread."""
    assert agent.kv is not None
    checkpoints, blocks = resident_blocks(agent.kv, len(agent.tokens))
    return CoolCache(list(agent.tokens), quantize_blocks(blocks, quantization), quantization, checkpoints)
