"""The cool tier: an idle agent's cache quantized in memory, between hot (the pool) and warm (disk).

The batch decodes only full-precision caches, so an agent is quantized only
while it waits: when the pool needs room, the least recently used idle
agent's K/V go through ``mx.quantize`` (--kv-bits-at-rest) and its
full-precision arrays are freed. The quantized copy (a ``CacheAtRest``)
stays in memory and is paid for in pool blocks by its real bytes (rounded up
to whole blocks), so at 8 bits a float32 agent frees about 7 of every 10
blocks it held and comes back with a dequantize instead of a disk read or a
prefill.

A cool agent that must go further is written to disk as it is (its blocks are
already what a quantized warm file holds).
"""

from __future__ import annotations

from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.runtime.tiers.agents import AgentRecord
from engine.store.cache_file import KVQuantization
from engine.store.kv_at_rest import CacheAtRest, as_block, hot_quantization, quantize_blocks
from engine.runtime.runner.kv.disk_slices import cache_slices, checkpoint_slices


def cool_copy(agent: AgentRecord, quantization: KVQuantization) -> CacheAtRest:
    """The agent's hot cache (shared prefix segments included, checkpoints too) quantized. Engine thread. (Not
    for a pool that quantizes its K/V itself: the engine keeps no cool tier then.)"""
    assert agent.kv is not None
    cache = at_rest(agent.kv, list(agent.tokens))
    return CacheAtRest(cache.tokens, quantize_blocks(cache.blocks, quantization), quantization, cache.checkpoints)


def at_rest(kv: SequenceKV, tokens: list[int], prefix: dict[str, int] | None = None) -> CacheAtRest:
    """A resident cache of ``tokens`` as blocks at rest, full precision (copies: the agent's cache can go).

    ``prefix``: a shared prefix file (``{"key", "n_tokens"}``) its first tokens
    are left to; its full-attention layers then start there."""
    full_from = prefix["n_tokens"] if prefix else 0
    checkpoints, at_checkpoints = checkpoint_slices(kv)
    blocks = tuple(as_block(s) for s in cache_slices(kv, len(tokens), full_from=full_from) + at_checkpoints)
    # (A pool that holds K/V quantized hands them over packed: the cache rests as the pool held it.)
    return CacheAtRest(tokens, blocks, hot_quantization(kv.spec), checkpoints, dict(prefix) if prefix else None)
