"""K/V quantized in the hot pool (--kv-bits): the pool counts the packed bytes exactly, agents decoding together
give mlx-lm's tokens with its own quantized cache, and a packed cache goes to disk, comes back, survives a restart
and is forked as it is (the same words, scales and biases), while files of another kind convert."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.models.loaded import LoadedModel
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.engine_seams import EngineSeams
from engine.runtime.engine_thread.engine_ops import EvictAgent, ForkAgent
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from engine.runtime.runner.backends.cpu.backend import CpuBackend
from engine.runtime.runner.backends.cpu.host_kv import HostQuantizedFullKV, UnpackedAttention
from engine.runtime.runner.backends.mlx import MlxBackend
from engine.runtime.runner.kv.quantized_kv import QuantizedAttention, QuantizedFullKV
from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.runtime.tiers.agents import Tier
from engine.store.cache_file import read_header
from engine.store.stored_model import stored_model
from engine.store.warm_store import WarmStore
from tests.support.byte_tokenizer import BOS
from tests.support.engine_settings import engine_settings
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit


def notes(i: int) -> tuple[int, ...]:
    facts = " ".join(f"item {k} of agent {i} weighs {k * 7 + i} kg." for k in range(5))
    return (BOS, *facts.encode())


def quantized(kind: str = "llama-hd64", bits: int = 8, group_size: int = 64) -> LoadedModel:
    loaded = loaded_tiny(kind)
    return replace(loaded, spec=loaded.spec.with_hot_kv(bits, group_size))


def mlx_lm_greedy(model, prompt: tuple[int, ...], n: int, bits: int, group_size: int = 64) -> list[int]:
    """Plain mlx-lm with its own quantized cache from the first token (its attention dispatches on the cache's
    ``bits``) on the layers it keeps full K/V for; a sliding window's cache stays as the model makes it."""
    caches = [QuantizedKVCache(group_size=group_size, bits=bits) if type(c) is KVCache else c
              for c in model.make_cache()]
    logits = model(mx.array([prompt]), cache=caches)[:, -1, :]
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[out[-1]]]), cache=caches)[:, -1, :]
    return out


def start(loaded: LoadedModel, root: Path | None = None, backend: MlxBackend | None = None) -> Engine:
    """An engine on ``loaded`` (``backend``: MLX's kernels, the arithmetic of the mlx-lm reference, unless given:
    the CPU backend attends over the unpacked K/V, whose products round differently)."""
    events = EventLog()
    store = WarmStore(root, stored_model(loaded), 1 << 30, events) if root is not None else None
    budget = 4 * loaded.spec.bytes_for_tokens(1024)  # room for every agent here
    engine = Engine(loaded, engine_settings(budget, 8, 32), store=store, events=events,
                    seams=EngineSeams(backend=backend or MlxBackend()))
    engine.start()
    return engine


def packed_positions(engine: Engine, agent: str, n: int) -> list[list[np.ndarray]]:
    """Each layer's first ``n`` keys and values as the pool holds them (packed words, scales, biases)."""
    def read(e: Engine) -> list[list[np.ndarray]]:
        layers = e.agents.get(agent).kv.layers
        assert all(isinstance(layer, QuantizedFullKV) for layer in layers)
        return [[np.array(a) for held in layer.positions(0, n) for a in held] for layer in layers]
    return engine.call(read).result()


# -- the pool ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_the_pool_counts_the_packed_bytes_exactly(bits: int) -> None:
    plain = loaded_tiny("llama-hd64").spec
    spec = plain.with_hot_kv(bits, 64)
    geometry = plain.geometry
    # Per token and layer: K and V packed at ``bits`` a value, a float32 scale and bias per 64 values.
    assert spec.group_token_bytes(spec.groups[0]) == geometry.n_kv_heads * 2 * (64 * bits // 8 + 2 * 4)
    assert spec.block_bytes * (32 // bits) < plain.block_bytes * 32 // bits
    kv = SequenceKV.empty(spec)
    kv.reserve(40)
    held = sum(int(a.nbytes) for layer in kv.layers for a in (*layer.keys, *layer.values))
    assert held == sum(kv.capacity_blocks().values()) * spec.block_bytes
    # The layout (the cache files' fingerprint) is the model's, whatever the pool holds.
    assert spec.describe() == plain.describe()


def test_a_sliding_window_keeps_full_precision_and_says_why() -> None:
    spec = loaded_tiny("gemma-hd32").spec.with_hot_kv(8, 32)
    sliding = [g for g in spec.groups if g.window is not None]
    assert sliding and spec.quantized_groups == {g.index for g in spec.groups if g.window is None}
    assert all("sliding window" in (spec.full_precision_reason(g) or "") for g in sliding)
    assert "full precision (a sliding window" in spec.hot_kv_summary()
    assert spec.with_hot_kv(None).quantized_groups == frozenset()
    wide = loaded_tiny("llama").spec.with_hot_kv(8, 128)  # its heads are narrower than one group
    assert not wide.quantized_groups and "split into no whole groups" in wide.hot_kv_summary()


# -- attention -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [QuantizedAttention, UnpackedAttention], ids=["mlx", "cpu"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "views"])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_attention_over_packed_kv_is_attention_over_the_values_they_hold(kind: type, contiguous: bool,
                                                                         mask: str | None) -> None:
    """Three key heads of nine query heads over 40 packed positions of a 256-position cache: as MLX's fused
    attention over the unpacked K/V, whether the packed arrays are views of the cache or copies of their own
    (a repeat axis broadcast against contiguous packed arrays is what MLX's CPU product got wrong)."""
    mx.random.seed(3)
    keys, values = (mx.quantize(mx.random.normal((1, 3, 256, 64)), group_size=64, bits=8) for _ in range(2))
    keys, values = (tuple(a[..., :40, :] for a in packed) for packed in (keys, values))
    if contiguous:
        keys, values = (tuple(mx.contiguous(a) for a in packed) for packed in (keys, values))
    queries = mx.random.normal((1, 9, 5, 64))
    attention = kind(8, 64)
    got = attention.sdpa(queries, keys, values, 0.125, mask)
    expected = mx.fast.scaled_dot_product_attention(queries, attention.unpacked(keys), attention.unpacked(values),
                                                    scale=0.125, mask=mask)
    assert mx.allclose(got, expected, atol=1e-5).item()


# -- decoding ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", [MlxBackend, CpuBackend], ids=["mlx", "cpu"])
def test_agents_decoding_together_give_mlx_lms_tokens_with_its_quantized_cache(bits: int, backend: type) -> None:
    loaded = quantized(bits=bits)
    engine = start(loaded, backend=backend())
    try:
        results = run_turns(engine, [GenerationRequest(f"a{i}", notes(i), 12) for i in range(3)])
        kinds = engine.call(lambda e: {type(layer) for layer in e.agents.get("a0").kv.layers}).result()
        assert kinds == {HostQuantizedFullKV if backend is CpuBackend else QuantizedFullKV}
    finally:
        engine.stop()
    for i, result in enumerate(results):
        assert result.tokens == mlx_lm_greedy(loaded.model, notes(i), 12, bits), i


def test_gemma3s_global_layers_quantized_beside_its_windows_give_mlx_lms_tokens() -> None:
    loaded = quantized("gemma-hd32", 8, 32)
    engine = start(loaded)
    try:
        results = run_turns(engine, [GenerationRequest(f"g{i}", notes(i), 10) for i in range(2)])
        kinds = engine.call(lambda e: [type(layer).__name__ for layer in e.agents.get("g0").kv.layers]).result()
    finally:
        engine.stop()
    assert "QuantizedFullKV" in kinds and len(set(kinds)) == 2, kinds
    for i, result in enumerate(results):
        assert result.tokens == mlx_lm_greedy(loaded.model, notes(i), 10, 8, 32), i


# -- the tiers: one format --------------------------------------------------------------------------------
def test_a_packed_cache_goes_to_disk_comes_back_and_survives_a_restart_as_it_was(tmp_path: Path) -> None:
    loaded = quantized()
    engine = start(loaded, tmp_path)
    first = run_turn(engine, GenerationRequest("a", notes(1), 8))
    n = len(notes(1))
    before = packed_positions(engine, "a", n)
    engine.call(EvictAgent("a", Tier.WARM)).result()
    engine.call(lambda e: e._store.flush()).result()
    path = engine.call(lambda e: e._store.entries["a"].path).result()
    assert read_header(path).kv_quantization == {"bits": 8, "group_size": 64}  # written as the pool held it
    follow = (*notes(1), *first.tokens, *b" and then")
    second = run_turn(engine, GenerationRequest("a", follow, 8))
    assert second.events[-1].usage.reused_tokens >= len(notes(1)) + len(first.tokens) - 1
    assert second.tokens == mlx_lm_greedy(loaded.model, follow, 8, 8)
    restored = packed_positions(engine, "a", n)
    assert all((x == y).all() for layer_a, layer_b in zip(before, restored) for x, y in zip(layer_a, layer_b))
    engine.stop()

    again = start(loaded, tmp_path)  # a restart: the warm file is the cache
    try:
        third = run_turn(again, GenerationRequest("a", (*follow, *second.tokens, *b" ok"), 6))
        assert third.events[-1].usage.reused_tokens >= len(follow)
        after_restart = packed_positions(again, "a", n)
        assert all((x == y).all() for layer_a, layer_b in zip(before, after_restart) for x, y in zip(layer_a, layer_b))
        # A fork shares the packed prefix as it is.
        again.call(ForkAgent("a", "b")).result()
        forked = packed_positions(again, "b", n)
        assert all((x == y).all() for layer_a, layer_b in zip(before, forked) for x, y in zip(layer_a, layer_b))
    finally:
        again.stop()


def test_a_full_precision_file_loads_into_a_quantized_pool_packed_once_and_back_unpacked(tmp_path: Path) -> None:
    plain = loaded_tiny("llama-hd64")
    engine = start(plain, tmp_path)
    first = run_turn(engine, GenerationRequest("a", notes(2), 8))
    full = engine.call(lambda e: [np.array(layer.positions(0, len(notes(2)))[0]) for layer in e.agents.get("a").kv.layers]).result()
    engine.stop()  # persisted on exit: a full-precision file

    packed_pool = quantized()
    engine = start(packed_pool, tmp_path)
    try:
        follow = (*notes(2), *first.tokens, *b" more")
        second = run_turn(engine, GenerationRequest("a", follow, 6))
        assert second.events[-1].usage.reused_tokens > len(notes(2))
        got = packed_positions(engine, "a", len(notes(2)))
    finally:
        engine.stop()
    for layer_full, layer_got in zip(full, got):
        words, scales, biases = (np.array(a) for a in mx.quantize(mx.array(layer_full), group_size=64, bits=8))
        assert (layer_got[0] == words).all() and (layer_got[1] == scales).all() and (layer_got[2] == biases).all()

    engine = start(plain, tmp_path)  # the packed file into a full-precision pool: unpacked
    try:
        third = run_turn(engine, GenerationRequest("a", (*follow, *second.tokens, *b" ok"), 4))
        assert third.events[-1].usage.reused_tokens >= len(follow)
    finally:
        engine.stop()


def test_a_file_of_gemma3_names_its_packed_groups_and_comes_back_with_its_windows_whole(tmp_path: Path) -> None:
    """Only the global layers are packed: the file's kv_quantization lists them, and the windows' blocks stay as
    they were computed."""
    loaded = quantized("gemma-hd32", 8, 32)
    engine = start(loaded, tmp_path)
    try:
        first = run_turn(engine, GenerationRequest("g", notes(3), 6))
        engine.call(EvictAgent("g", Tier.WARM)).result()
        engine.call(lambda e: e._store.flush()).result()
        path = engine.call(lambda e: e._store.entries["g"].path).result()
        assert read_header(path).kv_quantization == {"bits": 8, "group_size": 32, "groups": sorted(loaded.spec.quantized_groups)}
        follow = (*notes(3), *first.tokens, *b" then")
        second = run_turn(engine, GenerationRequest("g", follow, 6))
        assert second.events[-1].usage.reused_tokens >= len(notes(3))
        assert second.tokens == mlx_lm_greedy(loaded.model, follow, 6, 8, 32)
    finally:
        engine.stop()


def test_a_shared_prefix_file_holds_the_packed_blocks_a_new_agent_then_starts_from(tmp_path: Path) -> None:
    """The first agent's system prompt is stored packed (its kv_quantization the pool's); a later agent, after
    the first was deleted, starts from it with the first agent's very words, scales and biases."""
    loaded = quantized()
    system = (BOS, *b"You are one agent of a fleet. Rules: be brief, cite files, run the tests first. " * 2)
    stored = len(system) // loaded.spec.block_tokens * loaded.spec.block_tokens
    engine = start(loaded, tmp_path)
    try:
        run_turn(engine, GenerationRequest("first", (*system, *b"Task one."), 4, prefix_hint=len(system)))
        before = packed_positions(engine, "first", stored)
        engine.call(lambda e: e._store.flush()).result()
        (entry,) = engine.call(lambda e: list(e._store.prefixes.entries.values())).result()
        assert entry.kv_quantization == {"bits": 8, "group_size": 64}
        engine.call(lambda e: e.ops.delete_agent("first")).result()
        prompt = (*system, *b"Task two.")
        second = run_turn(engine, GenerationRequest("second", prompt, 4, prefix_hint=len(system)))
        usage = second.events[-1].usage
        assert usage.reuse_source.startswith("prefix:") and usage.reused_tokens == stored
        after = packed_positions(engine, "second", stored)
        assert all((x == y).all() for layer_a, layer_b in zip(before, after) for x, y in zip(layer_a, layer_b))
        assert second.tokens == mlx_lm_greedy(loaded.model, prompt, 4, 8)
    finally:
        engine.stop()
