"""A decode batch's attention over packed K/V on the host (backends/cpu/host_packed_decode.py, packed_kernels.py):
the step's own position packed as MLX packs it, attention as MLX's quantized attention computes it, and a whole
Llama decode step on the host over a quantized pool with MLX's logits and cache writes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turns
from engine.runtime.runner.backends.cpu import (
    host_decode,
    host_forward,
    host_packed_decode,
    packed_kernels,
)
from engine.runtime.runner.backends.cpu.backend import CpuBackend
from engine.runtime.runner.backends.cpu.host_kv import HostQuantizedFullKV
from engine.runtime.runner.kv.full_kv import KVShape
from engine.runtime.runner.kv.quantized_kv import QuantizedAttention, QuantizedFullKV
from tests.unit.test_host_forward import Row, llama_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def loops() -> None:
    host_packed_decode.warm_up()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_steps_own_position_is_packed_as_mlx_packs_it_bit_for_bit(bits: int, group: int) -> None:
    rng = np.random.default_rng(bits * group)
    heads, capacity, dim = 3, 4, 128
    cases = [rng.standard_normal((heads, dim)), rng.standard_normal((heads, dim)) * 1e-3,
             np.abs(rng.standard_normal((heads, dim))) * 40, -np.abs(rng.standard_normal((heads, dim))),
             np.full((heads, dim), 0.25)]  # (a constant group: the scale floor, MLX's eps)
    for new in (c.astype(np.float32) for c in cases):
        words = np.zeros((heads, capacity, dim * bits // 8), dtype=np.uint8)
        scales = np.zeros((heads, capacity, dim // group), dtype=np.float32)
        biases = np.zeros_like(scales)
        packed_kernels.pack_last(words.reshape(-1), scales.reshape(-1), biases.reshape(-1), capacity, 3, new, bits,
                                 group)
        w, s, b = (np.asarray(a)[0, :, 0] for a in mx.quantize(mx.array(new)[None, :, None, :], group_size=group,
                                                                 bits=bits))
        assert (words[:, 2] == w.view(np.uint8)).all()
        assert (scales[:, 2] == s).all() and (biases[:, 2] == b).all()
        assert not words[:, [0, 1, 3]].any()  # only its own position is written


def packed_row(rng: np.random.Generator, length: int, bits: int, group: int, heads: int = 2, dim: int = 64,
               capacity: int | None = None) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
    capacity = capacity or length
    keys, values = (mx.array(rng.standard_normal((1, heads, capacity, dim)).astype(np.float32)) for _ in range(2))
    k, v = (tuple(mx.quantize(a, group_size=group, bits=bits)) for a in (keys, values))
    mx.eval(k, v)
    return k, v


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("prefix", [0, 24], ids=["own-only", "with-a-shared-segment"])
def test_rows_attend_over_their_packed_parts_as_mlxs_quantized_attention_does(bits: int, prefix: int) -> None:
    rng = np.random.default_rng(bits + prefix)
    group, q_heads, dim = 32, 6, 64
    attention = QuantizedAttention(bits, group)
    segment = packed_row(rng, prefix, bits, group) if prefix else None
    rows = [packed_row(rng, n, bits, group, capacity=n + 9) for n in (5, 40, 17)]
    parts = [[*([(*segment, prefix)] if segment else []), (k, v, n)] for (k, v), n in zip(rows, (5, 40, 17))]
    queries = mx.array(rng.standard_normal((3, q_heads, 1, dim)).astype(np.float32))
    got = host_packed_decode.attend(queries, parts, 0.125, [None] * 3, bits, group)
    for b, row_parts in enumerate(parts):
        held = [tuple(a[..., :n, :] for a in k) for k, _, n in row_parts], \
            [tuple(a[..., :n, :] for a in v) for _, v, n in row_parts]
        keys, values = (tuple(mx.concatenate([p[i] for p in side], axis=2) for i in range(3)) for side in held)
        expected = attention.sdpa(queries[b:b + 1], keys, values, 0.125, None)
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(expected[0]), rtol=1e-5, atol=1e-5)


def test_a_claimed_position_is_packed_into_the_row_before_it_attends() -> None:
    rng = np.random.default_rng(3)
    bits, group = 8, 32
    rows = [packed_row(rng, 12, bits, group, capacity=16) for _ in range(2)]
    new_keys, new_values = (rng.standard_normal((2, 2, 64)).astype(np.float32) for _ in range(2))
    parts = [[(k, v, 13)] for k, v in rows]  # the 13th position is the step's own
    scaled = rng.standard_normal((2, 2, 64)).astype(np.float32)
    host_packed_decode.attend_host(scaled, parts, new_keys, new_values, [12, 12], bits, group)
    for b, (k, v) in enumerate(rows):
        for held, new in ((k, new_keys[b]), (v, new_values[b])):
            expected = mx.quantize(mx.array(new)[None, :, None, :], group_size=group, bits=bits)
            for own, e in zip(held, expected):
                assert (np.asarray(own)[0, :, 12] == np.asarray(e)[0, :, 0]).all()


def quantized_prefilled(model, tokens: list[int], kind: type, bits: int, group: int) -> list[QuantizedFullKV]:
    attn = model.model.layers[0].self_attn
    shape = KVShape(attn.n_kv_heads, attn.head_dim, attn.head_dim, mx.float32, bits, group)
    layers = [kind(shape, block_tokens=16) for _ in model.model.layers]
    for layer in layers:
        layer.reserve(len(tokens) + 8)
    mx.eval(model(mx.array([tokens]), cache=layers))
    return layers


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 3], ids=["1-row", "3-rows"])
def test_a_host_decode_step_over_a_quantized_pool_gives_mlxs_logits_and_the_same_packed_writes(
        bits: int, rows: int) -> None:
    group = 32
    model = llama_model(head_dim=64)
    backend = CpuBackend()
    backend.attach(model)
    prompts = [[(7 * b + i) % 97 for i in range(3 + 5 * b)] for b in range(rows)]
    host_rows = [Row(quantized_prefilled(model, p, HostQuantizedFullKV, bits, group)) for p in prompts]
    mlx_rows = [quantized_prefilled(model, p, QuantizedFullKV, bits, group) for p in prompts]
    tokens = [p[-1] for p in prompts]
    for _ in range(3):
        assert backend.steps_on_host(model, host_rows)
        got = np.asarray(backend.decode(model, mx.array(tokens, dtype=mx.uint32), host_rows))
        expected = np.concatenate([np.asarray(model(mx.array([[t]]), cache=layers)[:, -1, :])
                                   for t, layers in zip(tokens, mlx_rows)])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        assert (got.argmax(-1) == expected.argmax(-1)).all()
        for host_row, layers in zip(host_rows, mlx_rows):
            for mine, theirs in zip(host_row.layers, layers):
                assert mine.offset == theirs.offset
                # Every position as MLX packed it: the step's own from the host's keys, whose sums round a
                # little apart from MLX's (a value at a bin's edge may take the neighbouring code).
                for held, ref in zip(mine.positions(0, mine.offset), theirs.positions(0, theirs.offset)):
                    values, expected_values = (np.asarray(mx.dequantize(*p, group_size=group, bits=bits))
                                               for p in (held, ref))
                    np.testing.assert_allclose(values, expected_values, atol=1.01 * np.abs(np.asarray(ref[1])).max())
        tokens = [int(t) for t in got.argmax(-1)]
    backend.detach(model)
    backend.close()


@pytest.mark.parametrize("bits", [8, 4])
def test_drafts_and_prompt_chunks_over_a_quantized_pool_give_mlxs_logits_on_the_host(bits: int) -> None:
    """A verification's drafts and a prompt chunk riding a decode step attend to the packed values the pool then
    holds, as MLX's forward over mlx-lm's quantized attention does."""
    model = llama_model(head_dim=64)
    backend = CpuBackend()
    backend.attach(model)
    prompts = [[(7 * b + i) % 97 for i in range(3 + 5 * b)] for b in range(2)]
    host_rows = [Row(quantized_prefilled(model, p, HostQuantizedFullKV, bits, 32)) for p in prompts]
    mlx_rows = [quantized_prefilled(model, p, QuantizedFullKV, bits, 32) for p in prompts]
    for row in [r.layers for r in host_rows] + mlx_rows:
        for layer in row:
            layer.reserve(layer.offset + 64)
    drafts = [[5, 9, 11], [4, 6]]
    got, on_host = backend.verify(model, drafts, host_rows)
    assert on_host
    expected = [np.asarray(model(mx.array([d]), cache=layers)[0]) for d, layers in zip(drafts, mlx_rows)]
    np.testing.assert_allclose(np.asarray(got).reshape(-1, 97), np.concatenate(expected), rtol=1e-4, atol=1e-4)
    chunk = [(3 * i) % 97 for i in range(21)]
    assert backend.carries_prompts(model, host_rows[:1], [(host_rows[1], len(chunk))])
    got = np.asarray(backend.decode(model, mx.array([7], dtype=mx.uint32), host_rows[:1], [(host_rows[1], chunk)]))
    expected = np.asarray(model(mx.array([[7]]), cache=mlx_rows[0])[:, -1, :])
    mx.eval(model(mx.array([chunk]), cache=mlx_rows[1]))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    nxt = np.asarray(backend.decode(model, mx.array([1, 2], dtype=mx.uint32), host_rows))
    reference = np.concatenate([np.asarray(model(mx.array([[t]]), cache=layers)[:, -1, :])
                                for t, layers in zip((1, 2), mlx_rows)])
    # The chunk's positions hold what MLX packs: its keys, summed a little apart on the host, may fall into a
    # neighbouring bin at 4 bits (a position left unwritten would be off by far more).
    np.testing.assert_allclose(nxt, reference, rtol=1e-4, atol=1e-4 if bits == 8 else 1e-2)
    backend.detach(model)
    backend.close()


def test_an_engine_on_a_quantized_pool_decodes_on_the_host_with_mlx_lms_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit import test_quantized_kv as quantized_tests

    steps: list[int] = []
    real = host_forward.decode
    monkeypatch.setattr(host_forward, "decode", lambda *a, **k: steps.append(len(a[2])) or real(*a, **k))
    loaded = quantized_tests.quantized(bits=8)
    backend = CpuBackend()
    engine = quantized_tests.start(loaded, backend=backend)
    try:
        engine.call(lambda e: backend._load(host_packed_decode.warm_up, "_loops_ok", "decode attention")).result()
        results = run_turns(engine, [GenerationRequest(f"a{i}", quantized_tests.notes(i), 24) for i in range(3)])
    finally:
        engine.stop()
    assert steps and max(steps) == 3, steps
    for i, result in enumerate(results):
        assert result.tokens == quantized_tests.mlx_lm_greedy(loaded.model, quantized_tests.notes(i), 24, 8), i
