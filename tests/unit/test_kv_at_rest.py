"""K/V quantized at rest (--kv-bits-at-rest): the file format, the store, restarts across settings."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.domain.block_layout import block_spans
from engine.domain.cache_spec import ModelCacheSpec, group_layers
from engine.errors import CacheCorruptionError
from engine.models.loaded import ModelIdentity
from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.domain.event_log import EventKind, EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.cache_file import (
    CacheRecord,
    PersistedBlock,
    new_header,
    read_cache_file,
    read_header,
    spec_fingerprint,
    write_cache_file,
)
from engine.store.cache_file import KVQuantization, QuantizedArray
from engine.store.kv_at_rest import quantization_for, quantize_blocks
from engine.store.to_mlx import to_mx_slices
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.byte_tokenizer import EOS
from tests.support.reference import reference_greedy
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_engine_batching import prompt_for, without_eos

pytestmark = pytest.mark.unit

MODEL = ModelIdentity("wide", "ef" * 32)
B = 4
WINDOWS = [None, 4, None, 4]


def wide_spec() -> ModelCacheSpec:
    return ModelCacheSpec(n_layers=4, n_kv_heads=2, head_dim=64, dtype="float32", block_tokens=B,
                          groups=group_layers(WINDOWS), v_head_dim=32, layer_windows=tuple(WINDOWS))


def full_record(n_tokens: int = 10, quantization: KVQuantization | None = None) -> CacheRecord:
    spec = wide_spec()
    mx.random.seed(3)
    blocks = []
    for group in spec.groups:
        first = 0 if group.window is None else 4
        for span in block_spans(first, n_tokens, B):
            keys = tuple(mx.random.normal((1, 2, span.length, 64)) * 3 for _ in group.layers)
            values = tuple(mx.random.normal((1, 2, span.length, 32)) for _ in group.layers)
            mx.eval(keys, values)
            blocks.append(PersistedBlock(group.index, span.start, span.length, keys, values))
    classes = ["RotatingKVCache" if w else "KVCache" for w in WINDOWS]
    meta = [{"max_size": w, "keep": 0} if w else {} for w in WINDOWS]
    header = new_header("agent-q", MODEL, spec, list(range(1, n_tokens + 1)), classes, meta,
                        quantization=quantization)
    blocks_at_rest = tuple(blocks) if quantization is None else quantize_blocks(tuple(blocks), quantization)
    return CacheRecord(header, blocks_at_rest)


def read_back(path: Path) -> CacheRecord:
    return read_cache_file(path, MODEL.digest, spec_fingerprint(wide_spec()), expect_model_name=MODEL.name)


# -- the file format ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_file_round_trips_its_packed_words_scales_and_biases(tmp_path: Path, bits: int) -> None:
    quantization = KVQuantization(bits, 32)
    record = full_record(quantization=quantization)
    path = write_cache_file(tmp_path, record).path
    back = read_back(path)
    assert back.header.format_version == 2 and back.header.kv_quantization == {"bits": bits, "group_size": 32}
    written = sorted(record.blocks, key=lambda b: b.file_order)
    assert len(back.blocks) == len(written)
    for mine, theirs in zip(written, back.blocks):
        for wrote, read in zip((*mine.keys, *mine.values), (*theirs.keys, *theirs.values)):
            assert isinstance(read, QuantizedArray)
            for a, b in zip(wrote, read):
                assert np.array_equal(np.array(a), b)


@pytest.mark.parametrize(("bits", "bound"), [(8, 0.03), (4, 0.45)])
def test_a_restore_dequantizes_close_to_what_was_computed(tmp_path: Path, bits: int, bound: float) -> None:
    full = full_record()
    path = write_cache_file(tmp_path, full_record(quantization=KVQuantization(bits, 32))).path
    restored = to_mx_slices(read_back(path))
    originals = sorted(full.blocks, key=lambda b: b.file_order)
    worst = 0.0
    for block, layer in zip(originals, restored):
        for original, back in zip((*block.keys, *block.values), (*layer.keys, *layer.values)):
            assert back.shape == original.shape and back.dtype == original.dtype
            # Error relative to each group's range (8 bits: at most half a step of 255).
            worst = max(worst, float(mx.max(mx.abs(back - original)) / (mx.max(original) - mx.min(original))))
    assert 0 < worst < bound


def test_quantized_files_are_smaller_by_the_bits_and_full_precision_files_stay_version_1(tmp_path: Path) -> None:
    sizes = {}
    for bits in (None, 8, 4):
        quantization = None if bits is None else KVQuantization(bits, 32)
        written = write_cache_file(tmp_path / str(bits), full_record(quantization=quantization))
        header = read_header(written.path)
        sizes[bits] = header.tensor_bytes
        assert header.format_version == (1 if bits is None else 2)
    # float32 K/V: 4 bytes a value against 1 (8 bits) or 0.5 (4 bits), plus 8 bytes of scale and bias per 32.
    assert sizes[8] == sizes[None] * 1.25 / 4 and sizes[4] == sizes[None] * 0.75 / 4


def test_the_writer_refuses_blocks_that_do_not_match_the_header(tmp_path: Path) -> None:
    quantized = full_record(quantization=KVQuantization(8, 32))
    full = full_record()
    with pytest.raises(ValueError, match="would not read back"):
        write_cache_file(tmp_path, CacheRecord(full.header, quantized.blocks))
    with pytest.raises(ValueError, match="would not read back"):
        write_cache_file(tmp_path, CacheRecord(quantized.header, full.blocks))
    # A header claiming groups of 64, which do not divide the 32-dim values.
    claims_64 = replace(quantized.header, kv_quantization={"bits": 8, "group_size": 64})
    with pytest.raises(ValueError, match="does not fit head_dim 32"):
        write_cache_file(tmp_path, CacheRecord(claims_64, quantized.blocks))
    assert not list(tmp_path.iterdir())


def test_a_flipped_bit_in_a_quantized_file_is_caught(tmp_path: Path) -> None:
    path = write_cache_file(tmp_path, full_record(quantization=KVQuantization(8, 32))).path
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptionError, match="checksum mismatch"):
        read_back(path)


def test_a_group_size_is_chosen_per_head_dim(caplog: pytest.LogCaptureFixture) -> None:
    assert quantization_for(None, 64, 64) is None
    assert quantization_for(8, 64, 64) == KVQuantization(8, 64)
    assert quantization_for(4, 256, 256) == KVQuantization(4, 64)
    assert quantization_for(8, 96, 96) == KVQuantization(8, 32)
    with caplog.at_level(logging.WARNING, logger="semantic.store"):
        assert quantization_for(8, 80, 80) is None  # no group size mx.quantize offers divides 80
    assert "full precision" in caplog.text


# -- the store ------------------------------------------------------------------------------------
def engine_on(root: Path, kv_bits: int | None) -> Engine:
    loaded = loaded_tiny("llama-hd64")
    events = EventLog()
    store = WarmStore(root, stored_model(loaded), 1 << 30, events, kv_bits_at_rest=kv_bits)
    engine = Engine(loaded, engine_settings(64 * loaded.spec.block_bytes, 8, 32), store=store,
                    events=events)
    engine.start()
    return engine


def evict(engine: Engine, agent: str) -> Path:
    engine.call(lambda e: e.ops.evict_agent(agent, Tier.WARM)).result()
    engine.call(lambda e: e._store.flush()).result()
    return engine.call(lambda e: e._store.entries[agent].path).result()


def continued(engine: Engine, agent: str, first) -> object:
    prompt = first.request.prompt_tokens + tuple(first.tokens) + tuple(b" and then")
    return run_turn(engine, GenerationRequest(agent, prompt, 8))


def test_an_agent_spilled_at_8_bits_restores_and_continues_from_its_whole_cache(tmp_path: Path) -> None:
    sizes, reused = {}, {}
    for bits in (None, 8):
        engine = engine_on(tmp_path / str(bits), bits)
        try:
            first = run_turn(engine, GenerationRequest("a", prompt_for(0, 4), 8))
            path = evict(engine, "a")
            sizes[bits] = path.stat().st_size
            assert read_header(path).format_version == (1 if bits is None else 2)
            second = continued(engine, "a", first)
            reused[bits] = second.finish.usage.reused_tokens
            assert reused[bits] > len(first.request.prompt_tokens)
            assert any("from disk" in m for m in (e.message for e in engine.events.since(0)
                                                  if e.kind is EventKind.RESTORE))
            expected = without_eos(reference_greedy(engine.loaded.model, list(second.request.prompt_tokens), 8, {EOS}))
            # 8 bits of K/V: this model's greedy continuation is unchanged (bench_kv_at_rest measures real ones).
            assert second.tokens == expected
        finally:
            engine.stop()
    assert sizes[8] < 0.35 * sizes[None] and reused[8] == reused[None]


def test_files_of_either_kind_load_whatever_the_setting(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, None)
    try:
        exact = run_turn(engine, GenerationRequest("exact", prompt_for(1, 3), 6))
        evict(engine, "exact")
    finally:
        engine.stop()
    engine = engine_on(tmp_path, 8)
    try:
        packed = run_turn(engine, GenerationRequest("packed", prompt_for(2, 3), 6))
        evict(engine, "packed")
    finally:
        engine.stop()
    engine = engine_on(tmp_path, None)  # back to full precision: the 8-bit file still loads
    try:
        for agent, first in (("exact", exact), ("packed", packed)):
            second = continued(engine, agent, first)
            assert second.finish.usage.reused_tokens > len(first.request.prompt_tokens), agent
    finally:
        engine.stop()


def test_a_corrupt_quantized_file_is_quarantined_and_its_agent_goes_cold(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, 8)
    try:
        run_turn(engine, GenerationRequest("bad", prompt_for(3, 3), 6))
        path = evict(engine, "bad")
    finally:
        engine.stop()
    data = bytearray(path.read_bytes())
    data[-9] ^= 0xFF
    path.write_bytes(bytes(data))
    engine = engine_on(tmp_path, 8)
    try:
        result = run_turn(engine, GenerationRequest("bad", prompt_for(3, 3), 6))
        assert result.finish.usage.reused_tokens == 0  # prefilled again, not served from a torn file
        discards = [e.message for e in engine.events.since(0) if e.kind is EventKind.DISCARD]
        assert any("checksum mismatch" in m for m in discards), discards
        assert any(p.name.endswith(path.name) for p in (path.parent / "quarantine").iterdir())
    finally:
        engine.stop()


def test_an_agent_file_leaves_its_prefix_only_to_a_prefix_file_stored_the_same_way(tmp_path: Path) -> None:
    system = (256, *b"You are one agent of a fleet. Rules: be brief, cite files, run the tests first. " * 2)
    hint = len(system)

    def ask(engine: Engine, agent: str, task: bytes) -> None:
        run_turn(engine, GenerationRequest(agent, system + tuple(task), 6, prefix_hint=hint))

    def header_after_spill(engine: Engine, agent: str):
        return read_header(evict(engine, agent))

    engine = engine_on(tmp_path, None)
    try:
        ask(engine, "full-1", b"list the files")
        ask(engine, "full-2", b"run the tests")
        engine.call(lambda e: e._store.flush()).result()
        assert header_after_spill(engine, "full-2").prefix is not None  # the full-precision prefix file
    finally:
        engine.stop()
    engine = engine_on(tmp_path, 8)
    try:
        ask(engine, "packed", b"fix the bug")  # starts from the stored (full-precision) prefix
        header = header_after_spill(engine, "packed")
        # An 8-bit file holds all its blocks: an export or restore never mixes two kinds in one cache.
        assert header.format_version == 2 and header.prefix is None
    finally:
        engine.stop()
