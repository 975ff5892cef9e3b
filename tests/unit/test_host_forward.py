"""A Llama decode step on the host (backends/cpu/host_forward.py): MLX's logits and cache writes, and where it applies."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

from engine.runtime.runner.backends.cpu import host_forward
from engine.runtime.runner.backends.cpu.backend import HOST_PREFILL_MAX_TOKENS, CpuBackend, CpuOptions
from engine.runtime.runner.backends.cpu.host_kv import HostFullKV
from engine.runtime.runner.backends.mlx import MlxBackend
from engine.runtime.runner.kv.full_kv import FullKV, KVShape
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turns
from tests.support.byte_tokenizer import BOS
from tests.support.tiny_models import tiny_gemma3, tiny_llama
from tests.unit.test_engine_batching import make_engine

pytestmark = pytest.mark.unit


@dataclass
class Row:
    """What decode reads of a sequence's cache: its layers (and its arrays, for a pass of MLX's forward)."""

    layers: list[FullKV]

    def caches(self) -> list[FullKV]:
        return self.layers

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in (layer.keys, layer.values)]


def llama_model(seed: int = 0, **changes) -> llama.Model:
    mx.random.seed(seed)
    args = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, tie_word_embeddings=True)
    model = llama.Model(llama.ModelArgs(**{**args, **changes}))
    mx.eval(model.parameters())
    return model


def prefilled(model: llama.Model, tokens: list[int], kind: type[FullKV] = HostFullKV) -> list[FullKV]:
    attn = model.model.layers[0].self_attn
    shape = KVShape(attn.n_kv_heads, attn.head_dim, attn.head_dim, mx.float32)
    layers = [kind(shape, block_tokens=16) for _ in model.model.layers]
    for layer in layers:
        layer.reserve(len(tokens) + 8)
    mx.eval(model(mx.array([tokens]), cache=layers))
    return layers


def assert_same_caches(host_rows: list[Row], mlx_rows: list[list[FullKV]]) -> None:
    """Each row's layers hold what mlx-lm's forward wrote into the reference caches, at the same offsets."""
    for host_row, layers in zip(host_rows, mlx_rows):
        for mine, theirs in zip(host_row.layers, layers):
            assert mine.offset == theirs.offset
            np.testing.assert_allclose(np.asarray(mine.keys[..., :mine.offset, :]),
                                       np.asarray(theirs.keys[..., :theirs.offset, :]), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(mine.values[..., :mine.offset, :]),
                                       np.asarray(theirs.values[..., :theirs.offset, :]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes", [
    {},
    {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
    {"rope_traditional": True, "rope_theta": 500000.0, "head_dim": 32},
], ids=["smollm2-like", "biases-and-output-layer", "traditional-rope"])
@pytest.mark.parametrize("rows", [1, 3, 11], ids=["1-row", "3-rows", "11-rows-blas"])
def test_decode_steps_give_mlx_forward_logits_and_cache_writes(changes: dict, rows: int) -> None:
    model = llama_model(**changes)
    backend = CpuBackend()
    backend.attach(model)  # (its layers take the host pass only inside its forward: the reference below is MLX's)
    prompts = [[(7 * b + i) % 97 for i in range(3 + 5 * b)] for b in range(rows)]
    host_rows = [Row(prefilled(model, p)) for p in prompts]
    mlx_rows = [prefilled(model, p, FullKV) for p in prompts]
    tokens = [p[-1] for p in prompts]
    for step in range(3):
        assert backend.steps_on_host(model, host_rows)
        got = np.asarray(backend.decode(model, mx.array(tokens, dtype=mx.uint32), host_rows))
        expected = np.concatenate([np.asarray(model(mx.array([[t]]), cache=layers)[:, -1, :])
                                   for t, layers in zip(tokens, mlx_rows)])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        assert (got.argmax(-1) == expected.argmax(-1)).all()
        assert_same_caches(host_rows, mlx_rows)
        tokens = [int(t) for t in got.argmax(-1)]
    backend.detach(model)
    backend.close()


def test_a_short_prefill_pass_of_chunks_alone_runs_on_the_host_and_writes_what_mlx_forward_writes() -> None:
    """With nothing decoding, chunks of up to HOST_PREFILL_MAX_TOKENS together take the host path (MLX's forward
    costs more than its arithmetic there): each chunk unpadded, no logits, the caches as MLX's forward leaves them.
    Longer passes, and a backend with the path off, stay with MLX's forward."""
    model = llama_model()
    backend = CpuBackend()
    backend.attach(model)
    starts = [[(5 * b + 3 * i) % 97 for i in range(4 + 9 * b)] for b in range(3)]
    host_prompts = [Row(prefilled(model, p)) for p in starts]
    mlx_prompts = [prefilled(model, p, FullKV) for p in starts]
    for layers in [r.layers for r in host_prompts] + mlx_prompts:
        for layer in layers:
            layer.reserve(layer.offset + HOST_PREFILL_MAX_TOKENS + 8)
    for step in range(2):
        chunks = [[(11 * step + 13 * b + i) % 97 for i in range(1 + 9 * b + step)] for b in range(3)]
        assert backend.carries_prompts(model, [], [(r, len(c)) for r, c in zip(host_prompts, chunks)])
        got = backend.decode(model, mx.zeros((0,), dtype=mx.uint32), [], list(zip(host_prompts, chunks)))
        assert got.shape == (0, 97)
        for chunk, layers in zip(chunks, mlx_prompts):
            mx.eval(model(mx.array([chunk]), cache=layers))
        assert_same_caches(host_prompts, mlx_prompts)
    assert not backend.carries_prompts(model, [], [(host_prompts[0], HOST_PREFILL_MAX_TOKENS + 1)])
    assert not backend.carries_prompts(model, [], [(host_prompts[0], 40), (host_prompts[1], 40)])
    off = CpuBackend(CpuOptions(host_prefill=False))
    off.attach(model)
    assert not off.carries_prompts(model, [], [(host_prompts[0], 4)])
    assert off.carries_prompts(model, [Row(prefilled(model, [1, 2, 3]))], [(host_prompts[0], 4)])  # riding still
    for b in (backend, off):
        b.detach(model)
        b.close()


@pytest.mark.parametrize("decoding", [1, 3], ids=["1-decoding", "3-decoding"])
def test_prompt_chunks_ride_a_decode_step_with_mlx_forward_logits_and_cache_writes(decoding: int) -> None:
    """Prompt chunks fed in a decode step's pass write what a prefill pass of their own writes, and the decoding
    rows' logits are what they are without them."""
    model = llama_model()
    backend = CpuBackend()
    backend.attach(model)
    prompts = [[(7 * b + i) % 97 for i in range(3 + 5 * b)] for b in range(decoding)]
    host_rows = [Row(prefilled(model, p)) for p in prompts]
    mlx_rows = [prefilled(model, p, FullKV) for p in prompts]
    starts = [[(5 * b + 3 * i) % 97 for i in range(4 + 9 * b)] for b in range(2)]
    host_prompts = [Row(prefilled(model, p)) for p in starts]
    mlx_prompts = [prefilled(model, p, FullKV) for p in starts]
    for layers in [r.layers for r in host_prompts] + mlx_prompts:
        for layer in layers:
            layer.reserve(layer.offset + 64)
    tokens = [p[-1] for p in prompts]
    for step in range(3):
        chunks = [[(11 * step + 13 * b + i) % 97 for i in range(5 + 7 * b + step)] for b in range(2)]
        assert backend.carries_prompts(model, host_rows, [(r, len(c)) for r, c in zip(host_prompts, chunks)])
        got = np.asarray(backend.decode(model, mx.array(tokens, dtype=mx.uint32), host_rows,
                                        list(zip(host_prompts, chunks))))
        assert got.shape == (decoding, 97)
        expected = np.concatenate([np.asarray(model(mx.array([[t]]), cache=layers)[:, -1, :])
                                   for t, layers in zip(tokens, mlx_rows)])
        for chunk, layers in zip(chunks, mlx_prompts):
            mx.eval(model(mx.array([chunk]), cache=layers))
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        assert (got.argmax(-1) == expected.argmax(-1)).all()
        assert_same_caches(host_rows + host_prompts, mlx_rows + mlx_prompts)
        tokens = [int(t) for t in got.argmax(-1)]
    host_prompts[0].layers[0].trim_to(2)  # rewound: its next positions may not be written in place
    assert not backend.carries_prompts(model, host_rows, [(host_prompts[0], 4)])
    mlx_backend = MlxBackend()  # MLX's forward: chunks in passes of their own, the same writes
    assert not mlx_backend.carries_prompts(model, host_rows, [(host_prompts[1], 4)])
    chunk = [3, 1, 4, 1, 5]
    mlx_backend.decode(model, mx.array(tokens[:1], dtype=mx.uint32), [Row(mlx_rows[0])], [(Row(mlx_prompts[1]), chunk)])
    mx.eval(model(mx.array([chunk]), cache=host_prompts[1].layers))
    assert_same_caches([host_prompts[1]], [mlx_prompts[1]])
    backend.detach(model)
    backend.close()


@pytest.mark.parametrize("traditional", [False, True])
def test_rotations_are_bit_identical_to_mlx_rope(traditional: bool) -> None:
    rope = nn.RoPE(32, traditional=traditional, base=100000.0)
    x = np.random.default_rng(0).standard_normal((5, 3, 32)).astype(np.float32)
    positions = np.array([0, 1, 4095, 4096, 40000])  # (the last two grow the table)
    cos, sin = host_forward.RopeTables().at(host_forward._Rope(32, traditional, 100000.0, 1.0), positions)
    got = host_forward._rotate(x, cos, sin, rope)
    for b, position in enumerate(positions):
        expected = mx.fast.rope(mx.array(x[b:b + 1, :, None, :]), 32, traditional=traditional, base=100000.0,
                                scale=1.0, offset=int(position))
        assert np.array_equal(got[b], np.asarray(expected)[0, :, 0, :])


def test_rms_norm_and_swiglu_agree_with_mlx_and_overflow_quietly() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(np.float32) * 3
    norm = nn.RMSNorm(64, eps=1e-5)
    norm.weight = mx.array(rng.standard_normal(64).astype(np.float32))
    np.testing.assert_allclose(host_forward._rms_norm(x, norm), np.asarray(norm(mx.array(x))), rtol=1e-5, atol=1e-6)
    gate = np.array([[-200.0, -30.0, -1.0, 0.0, 2.5, 90.0]], dtype=np.float32)
    up = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = host_forward._swiglu(gate, up)
    np.testing.assert_allclose(got, np.asarray(nn.silu(mx.array(gate)) * mx.array(up)), rtol=1e-5, atol=1e-30)  # a few ulp


def test_it_supports_only_models_whose_every_part_it_knows() -> None:
    assert host_forward.supports(tiny_llama())
    assert not host_forward.supports(tiny_gemma3())  # sliding windows, Gemma's norms
    quantized = llama_model(hidden_size=64, intermediate_size=128)
    nn.quantize(quantized, group_size=32, bits=4)
    assert not host_forward.supports(quantized)
    assert not host_forward.supports(llama_model(rope_scaling={"type": "llama3", "factor": 8.0,
                                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                               "original_max_position_embeddings": 8192},
                                                 max_position_embeddings=131072))
    assert not host_forward.supports(llama_model(layer_types=["full_attention", "sliding_attention"], sliding_window=8))
    half = llama_model()
    half.set_dtype(mx.float16)
    assert not host_forward.supports(half)


def test_it_applies_only_where_every_row_may_be_written_in_place() -> None:
    model = llama_model()
    backend = CpuBackend()
    backend.attach(model)
    rows = [Row(prefilled(model, [1, 2, 3])), Row(prefilled(model, [4, 5]))]
    assert backend.steps_on_host(model, rows)
    rows[1].layers[0].trim_to(1)  # rewound: a view taken before may show position 1
    assert not backend.steps_on_host(model, rows)
    rows[1] = Row(prefilled(model, [4, 5]))
    assert not backend.steps_on_host(model, [Row(prefilled(model, [4, 5], FullKV))])  # the MLX backend's caches
    backend._loops_ok = False  # the compiled loops did not load
    assert not backend.steps_on_host(model, rows)
    backend.detach(model)
    off = CpuBackend(CpuOptions(host_step=False))
    off.attach(model)
    assert not off.steps_on_host(model, rows)
    assert not backend.steps_on_host(model, rows)  # detached: nothing is known of the model


def test_an_engine_decodes_llama_on_the_host_with_the_tokens_of_mlx_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = host_forward.decode
    monkeypatch.setattr(host_forward, "decode", lambda *a: calls.append(len(a[2])) or real(*a))
    prompts = [(BOS, *(f"agent {i} writes a longer line. " * (2 + i)).encode()) for i in range(4)]

    def decode(options: CpuOptions) -> list[list[int]]:
        engine = make_engine("llama", backend=CpuBackend(options))
        try:
            return [r.tokens for r in run_turns(engine, [GenerationRequest(f"a{i}", p, 40)
                                                         for i, p in enumerate(prompts)])]
        finally:
            engine.stop()

    on_host = decode(CpuOptions())
    assert calls and max(calls) == 4 and min(calls) >= 1, calls
    calls.clear()
    assert decode(CpuOptions(host_step=False)) == on_host and not calls


def test_an_engine_feeds_prompt_chunks_in_its_decode_passes_with_the_same_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While agents decode, a long prompt's chunks (all but its last) go through the decode steps' passes on the
    host; every agent's tokens are what they are with each chunk in a prefill pass of its own."""
    carried = []
    real = host_forward.decode
    # (decode's eighth argument: how many of its rows are prompt chunks)
    monkeypatch.setattr(host_forward, "decode", lambda *a: carried.append(a[7] if len(a) > 7 else 0) or real(*a))
    short = [(BOS, *f"agent {i} writes a short line.".encode()) for i in range(3)]
    long = (BOS, *("a long prompt that takes several chunks to read. " * 6).encode())

    def decode(rides: bool) -> list[list[int]]:
        backend = CpuBackend()
        if not rides:
            monkeypatch.setattr(backend, "carries_prompts", lambda *a: False)
        engine = make_engine("llama", backend=backend, prefill_step=32)
        try:
            requests = [GenerationRequest(f"a{i}", p, 40) for i, p in enumerate(short)]
            return [r.tokens for r in run_turns(engine, [*requests, GenerationRequest("long", long, 8)])]
        finally:
            engine.stop()

    riding = decode(True)
    assert any(prompt_rows > 0 for prompt_rows in carried), carried
    carried.clear()
    assert decode(False) == riding and not any(prompt_rows > 0 for prompt_rows in carried)


def test_an_engine_runs_short_prefill_passes_on_the_host_with_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing decoding, a prompt's prefill pass of at most HOST_PREFILL_MAX_TOKENS runs on the host (rows:
    only prompt chunks); an agent's two turns give the tokens they give with every prefill pass through MLX's
    forward, and a prompt longer than the limit still takes MLX's forward."""
    alone = []
    real = host_forward.decode
    # (a pass whose rows are all prompt chunks: decode's eighth argument equals its row count)
    monkeypatch.setattr(host_forward, "decode",
                        lambda *a: (alone.append(a[6]) if len(a) > 7 and a[7] == len(a[2]) else None) or real(*a))
    first = (BOS, *b"agent one asks a short question.")

    def turns(options: CpuOptions) -> list[list[int]]:
        engine = make_engine("llama", backend=CpuBackend(options), prefill_step=2 * HOST_PREFILL_MAX_TOKENS)
        try:
            one = run_turns(engine, [GenerationRequest("a", first, 12)])[0]
            grown = (*first, *one.tokens, *b" and a follow-up.")
            two = run_turns(engine, [GenerationRequest("a", grown, 12)])[0]
            short_passes = len(alone)
            long = run_turns(engine, [GenerationRequest("b", (BOS, *(b"x" * (HOST_PREFILL_MAX_TOKENS + 20))), 4)])[0]
            on_host = sum(sum(widths) for widths in alone[short_passes:])
            assert on_host < HOST_PREFILL_MAX_TOKENS  # its longest pass went through MLX's forward
            return [one.tokens, two.tokens, long.tokens]
        finally:
            engine.stop()

    on_host = turns(CpuOptions())
    assert len(alone) >= 2 and all(sum(widths) <= HOST_PREFILL_MAX_TOKENS for widths in alone), alone
    alone.clear()
    assert turns(CpuOptions(host_prefill=False)) == on_host and not alone
