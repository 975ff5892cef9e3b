"""A hybrid agent's cache file: recurrent states and their snapshots beside the attention blocks.

The file holds each recurrent group's state at the cache's end
(``g{group}.s{offset}.l{slot}.a{j}``) and one per snapshot (``c{i}.g...``),
each array in the spec's own dtype, never quantized. These tests read a
file a real engine wrote (a tiny Qwen3-Next: gated delta net layers beside
attention layers) and check that the bytes are the state's, and that the
writer (whose checks are the reader's) refuses a record that lost or bent a
state.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.engine_ops import EvictAgent
from engine.runtime.engine_thread.sync_client import run_turn
from engine.runtime.tiers.agents import Tier
from engine.store.cache_file import CacheRecord, read_cache_file, spec_fingerprint, write_cache_file
from engine.store.to_mlx import to_mx_slices
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.family_engine import opening, start
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen3-Next agent after two turns, evicted to disk: (loaded model, its state in memory, the file)."""
    loaded = loaded_tiny("qwen3_next")
    root = tmp_path_factory.mktemp("hybrid")
    engine = start(loaded, WarmStore(root, stored_model(loaded), 1 << 30, EventLog()))
    try:
        first = run_turn(engine, GenerationRequest("a", opening(3), 8))
        run_turn(engine, GenerationRequest("a", opening(3) + tuple(first.tokens) + tuple(b" and more?"), 8))

        def state(e):
            kv = e.agents.get("a").kv
            own = {i: [np.array(a) for a in layer.arrays] for i, layer in enumerate(kv.layers) if hasattr(layer, "geometry")}
            return kv.offset, own, [c.offset for c in kv.checkpoints]

        memory = engine.call(state).result(30)
        engine.call(EvictAgent("a", Tier.WARM)).result(30)
        engine.call(lambda e: e._store.flush()).result(30)
    finally:
        engine.stop()
    (path,) = [p for p in root.rglob("*.safetensors") if "prefixes" not in p.parts]
    return loaded, memory, path


def _read(loaded, path: Path) -> CacheRecord:
    return read_cache_file(path, loaded.identity.digest, spec_fingerprint(loaded.spec))


def test_the_file_holds_the_state_and_each_snapshot_bit_for_bit(written) -> None:
    loaded, (offset, own, snapshot_offsets), path = written
    record = _read(loaded, path)
    assert record.header.n_tokens == offset
    assert [c["offset"] for c in record.header.checkpoints] == sorted(snapshot_offsets)
    states = [b for b in record.blocks if b.states]
    groups = loaded.spec.recurrent_groups
    # One state per recurrent group at the end, and one per group per snapshot.
    assert len(states) == len(groups) * (1 + len(snapshot_offsets))
    slices = {(s.group, s.checkpoint): s for s in to_mx_slices(record) if s.states}
    for group in groups:
        mine = slices[(group.index, None)]
        assert mine.start == offset and mine.length == 0 and not mine.keys
        for slot, layer in enumerate(group.layers):
            for j, (shape, dtype) in enumerate(group.state.arrays):
                restored = mine.states[slot][j]
                assert restored.shape == (1, *shape) and restored.dtype == getattr(mx, dtype)
                assert np.array_equal(np.array(restored), own[layer][j])


def test_other_readers_see_plain_tensors_named_for_the_layer_and_position(written) -> None:
    loaded, (offset, _, _), path = written
    group = loaded.spec.recurrent_groups[0]
    with safe_open(str(path), framework="numpy") as f:
        names = set(f.keys())
        assert f"g{group.index}.s{offset}.l0.a0" in names
        assert any(n.startswith("c0.g") and ".s" in n for n in names)


def test_the_writer_refuses_a_record_that_lost_a_state(written, tmp_path: Path) -> None:
    loaded, _, path = written
    record = _read(loaded, path)
    own_state = next(b for b in record.blocks if b.states and b.checkpoint is None)
    without = tuple(b for b in record.blocks if b is not own_state)
    with pytest.raises(ValueError, match=rf"group {own_state.group} holds recurrent states at tokens \[\]"):
        write_cache_file(tmp_path, CacheRecord(record.header, without))
    snapshot = next(b for b in record.blocks if b.states and b.checkpoint == 0)
    with pytest.raises(ValueError, match="checkpoint 0 group"):
        write_cache_file(tmp_path, CacheRecord(record.header, tuple(b for b in record.blocks if b is not snapshot)))
    assert not list(tmp_path.iterdir())


def test_the_writer_refuses_a_state_of_the_wrong_shape_or_position(written, tmp_path: Path) -> None:
    loaded, _, path = written
    record = _read(loaded, path)
    index = next(i for i, b in enumerate(record.blocks) if b.states and b.checkpoint is None)
    block = record.blocks[index]
    bent = tuple(tuple(np.ascontiguousarray(a[..., :1]) for a in slot) for slot in block.states)
    for changed, message in ((replace(block, states=bent), "the spec's state needs"),
                             (replace(block, start=block.start - 1), "it needs exactly one, at token"),
                             (replace(block, states=tuple(slot[:-1] for slot in block.states)), "arrays per layer")):
        blocks = record.blocks[:index] + (changed,) + record.blocks[index + 1:]
        with pytest.raises(ValueError, match=message):
            write_cache_file(tmp_path, CacheRecord(record.header, blocks))


def test_a_rewritten_record_reads_back_identically(written, tmp_path: Path) -> None:
    loaded, _, path = written
    record = _read(loaded, path)
    copy = write_cache_file(tmp_path, replace(record, header=replace(record.header)))
    assert copy.path.read_bytes() == path.read_bytes()
