"""Llama 4's chunked layers: checkpoints that share the run until it moves on, then keep only their chunk."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.runtime.runner.kv.chunked_kv import ChunkedKV
from engine.runtime.runner.kv.sequence_kv import CheckpointKind, SequenceKV
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit


def run(model, kv: SequenceKV, tokens: list[int]) -> mx.array:
    kv.reserve(kv.offset + len(tokens))
    logits = model(mx.array([tokens]), cache=kv.caches())
    mx.eval(logits)
    return logits[0, -1]


def test_a_checkpoint_costs_nothing_until_its_chunk_leaves_the_run_then_only_its_chunk() -> None:
    loaded = loaded_tiny("llama4")  # chunks of 24 tokens, blocks of 16
    spec, model = loaded.spec, loaded.model
    chunked = [g for g in spec.groups if g.chunk]
    kv = SequenceKV.empty(spec)
    run(model, kv, list(range(1, 31)))  # 30 tokens: the chunk so far is positions 24-29
    before = kv.capacity_blocks()
    kv.take_checkpoint(CheckpointKind.TURN, 4)
    assert kv.capacity_blocks() == before
    assert kv.array_bytes() == kv.nbytes

    predicted = kv.blocks_for(100)
    run(model, kv, list(range(31, 101)))  # a prompt is reserved whole: the run still holds position 24 on
    assert kv.capacity_blocks() == predicted
    blocks = sum(kv.capacity_blocks().values())
    kv.shrink()  # after the turn: the run keeps its chunk's reach (from 64), the checkpoint its own chunk
    assert sum(kv.capacity_blocks().values()) < blocks
    assert kv.array_bytes() == kv.nbytes
    for group in chunked:
        layer = kv.layers[group.layers[0]]
        assert isinstance(layer, ChunkedKV) and layer.base > 24
        state = kv.checkpoints[0].states[kv.window_layer_ids().index(group.layers[0])]
        assert not layer.shares(state) and (state.oldest, state.capacity) == (24, 16)  # 6 tokens, one block

    # Back to the checkpoint: the next token's logits are a fresh prefill's.
    assert kv.continue_from(30) == 30
    resumed = run(model, kv, [31])
    fresh = run(model, SequenceKV.empty(spec), list(range(1, 32)))
    assert mx.allclose(resumed, fresh, atol=1e-4).item()


def test_a_checkpoint_on_a_chunk_boundary_holds_nothing() -> None:
    loaded = loaded_tiny("llama4")
    kv = SequenceKV.empty(loaded.spec)
    run(loaded.model, kv, list(range(1, 49)))  # 48 tokens: two whole chunks
    kv.take_checkpoint(CheckpointKind.TURN, 4)
    run(loaded.model, kv, list(range(49, 121)))
    kv.shrink()
    assert all(state.keys is None for state in kv.checkpoints[0].states)
    assert kv.array_bytes() == kv.nbytes
    assert kv.continue_from(48) == 48
    resumed = run(loaded.model, kv, [49])
    fresh = run(loaded.model, SequenceKV.empty(loaded.spec), list(range(1, 50)))
    assert mx.allclose(resumed, fresh, atol=1e-4).item()
