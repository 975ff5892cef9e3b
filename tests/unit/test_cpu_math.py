"""cpu_math: the CPU's softmax, SiLU, GELU and attention agree with MLX's own to float32 rounding."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu
from mlx.nn.layers.activations import gelu_approx as mlx_gelu_approx

from engine.runtime.runner.backends.cpu import cpu_math
from engine.runtime.runner.backends.cpu.host_attention import HOST_ATTENTION, HOST_ATTENTION_IN_GRAPH
from engine.runtime.runner.backends.cpu.backend import CpuBackend
from engine.runtime.runner.backends.mlx import MlxBackend
from engine.runtime.runner.kv.kinds import MLX_KINDS
from engine.runtime.runner.kv.sequence_kv import SequenceKV
from tests.support.attention_inputs import make_mask, qkv as _qkv
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit


def ulps(a: mx.array, b: mx.array) -> np.ndarray:
    """Distance in units of float32's last place, per element."""
    x = np.array(a, dtype=np.float32).view(np.int32).astype(np.int64)
    y = np.array(b, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.abs(x - y)


def test_exp_is_within_two_ulp_of_mlx_over_float32s_range() -> None:
    # Normal results only: below -87.3 mx.exp returns denormals and this returns 0; above 88 both overflow.
    x = mx.concatenate([mx.linspace(-87.3, 88.0, 200_001), mx.array([0.0, 1.0, -1.0, 1e-30, -1e-30])])
    assert ulps(cpu_math.exp(x), mx.exp(x)).max() <= 2


def test_exp_underflows_to_zero_and_overflows_to_infinity() -> None:
    out = np.array(cpu_math.exp(mx.array([-mx.inf, -1000.0, -88.0, 88.01, 1000.0, mx.inf])))
    assert out[:3].tolist() == [0.0, 0.0, 0.0]
    assert np.isinf(out[3:]).all() and (out[3:] > 0).all()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-80, 80, width=32), min_size=1, max_size=64))
def test_exp_property_relative_error(values: list[float]) -> None:
    x = mx.array(values, dtype=mx.float32)
    np.testing.assert_allclose(np.array(cpu_math.exp(x)), np.array(mx.exp(x)), rtol=2.5e-7)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_softmax_matches_mlx_precise_softmax_and_keeps_the_dtype(dtype: mx.Dtype) -> None:
    scores = (mx.random.normal((4, 9, 300), key=mx.random.key(1)) * 8).astype(dtype)
    ours = cpu_math.softmax(scores)
    assert ours.dtype == dtype
    theirs = mx.softmax(scores, axis=-1, precise=True)
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)),
                               atol=1e-6 if dtype == mx.float32 else 1e-2)
    np.testing.assert_allclose(np.array(ours.astype(mx.float32).sum(-1)), 1.0, rtol=1e-5 if dtype == mx.float32 else 1e-2)


def test_softmax_of_masked_scores_gives_masked_positions_zero_weight() -> None:
    scores = mx.array([[0.0, 1.0, mx.finfo(mx.float32).min, -mx.inf]])
    weights = np.array(cpu_math.softmax(scores))
    assert weights[0, 2:].tolist() == [0.0, 0.0]
    np.testing.assert_allclose(weights[0, :2], np.array(mx.softmax(scores[:, :2], axis=-1))[0], rtol=1e-6)


def test_swiglu_matches_mlx_lm() -> None:
    gate = mx.random.normal((16, 1536), key=mx.random.key(2)) * 6
    x = mx.random.normal((16, 1536), key=mx.random.key(3))
    np.testing.assert_allclose(np.array(cpu_math.swiglu(gate, x)), np.array(mlx_lm_swiglu(gate, x)),
                               rtol=1e-5, atol=1e-6)
    assert cpu_math.swiglu(gate.astype(mx.bfloat16), x.astype(mx.bfloat16)).dtype == mx.bfloat16


def test_gelu_approx_is_closer_to_the_exact_formula_than_mlx_and_within_its_rounding() -> None:
    x = mx.linspace(-30, 30, 600_001)
    fast, mlx = np.array(cpu_math.gelu_approx(x)), np.array(mlx_gelu_approx(x))
    x64 = np.array(x).astype(np.float64)
    exact = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))
    # MLX's 1 + tanh(u) cancels where tanh(u) is near -1 (x below about -2): its relative error there
    # reaches ~5e-5; x / (1 + exp(-2u)) keeps ~1e-6. Both round |y| ~ 30 to ~5e-7.
    large = np.abs(exact) > 1e-3
    fast_rel = (np.abs(fast - exact)[large] / np.abs(exact[large])).max()
    assert fast_rel < 2e-6 < (np.abs(mlx - exact)[large] / np.abs(exact[large])).max()
    assert np.abs(fast - exact).max() < 1e-6 and np.abs(fast - mlx).max() < 1e-6


def test_gelu_approx_ends_like_mlx_and_keeps_the_dtype() -> None:
    ends = mx.array([-1e30, -100.0, -12.0, -0.0, 0.0, 1e30, mx.inf])
    assert np.array(cpu_math.gelu_approx(ends)).tolist() == np.array(mlx_gelu_approx(ends)).tolist()
    assert np.isnan(np.array(cpu_math.gelu_approx(mx.array([mx.nan])))).all()
    x = mx.random.normal((8, 2048), key=mx.random.key(4)).astype(mx.bfloat16)
    assert cpu_math.gelu_approx(x).dtype == mx.bfloat16


@pytest.mark.parametrize("name, slope", [("silu", 1.0), ("gelu_fast_approx", 1.702)])
def test_x_times_sigmoid_is_mlxs_to_its_rounding_and_ends_like_it(name: str, slope: float) -> None:
    """``silu`` and ``gelu_fast_approx`` (vision towers' activations, hooks.install_vision) against MLX's and the
    exact ``x * sigmoid(slope x)`` in float64."""
    import mlx.nn as nn

    x = mx.linspace(-30, 30, 600_001)
    fast, mlx = np.array(getattr(cpu_math, name)(x)), np.array(getattr(nn, name)(x))
    x64 = np.array(x).astype(np.float64)
    exact = x64 / (1 + np.exp(-slope * x64))
    assert np.abs(fast - exact).max() < 1e-5 and np.abs(fast - mlx).max() < 1e-5
    large = np.abs(exact) > 1e-3
    assert (np.abs(fast - exact)[large] / np.abs(exact[large])).max() < 2e-6
    ends = mx.array([-1e30, -100.0, -0.0, 0.0, 1e30, mx.inf])
    assert np.array(getattr(cpu_math, name)(ends)).tolist() == np.array(getattr(nn, name)(ends)).tolist()
    assert getattr(cpu_math, name)(x.astype(mx.bfloat16)).dtype == mx.bfloat16


def test_the_cpu_backend_routes_gemmas_gelu_only_inside_its_own_forward(monkeypatch) -> None:
    monkeypatch.setattr(cpu_math, "MIN_ELEMENTS", 0)
    loaded = loaded_tiny("gemma")
    calls: list[str] = []
    fast_gelu = cpu_math.gelu_approx
    monkeypatch.setattr(cpu_math, "gelu_approx", lambda x: (calls.append("gelu"), fast_gelu(x))[1])
    backend = CpuBackend()
    try:
        backend.attach(loaded.model)
        backend.attach(loaded.model)  # attaching twice wraps once
        assert nn.gelu_approx.__wrapped__ is mlx_gelu_approx
        tokens = mx.array([[3, 14, 15, 92, 65, 35]])
        plain = loaded.model(tokens)
        assert calls == []
        fast = backend.forward(loaded.model, tokens, None)
        assert calls == ["gelu"] * len(loaded.model.layers)
        np.testing.assert_allclose(np.array(fast), np.array(plain), atol=1e-4)
        calls.clear()
        MlxBackend().forward(loaded.model, tokens, None)
        assert calls == []  # --no-fast-cpu-math
    finally:
        backend.detach(loaded.model)
    assert nn.gelu_approx is mlx_gelu_approx


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "per-head bool", "per-row bool"])
@pytest.mark.parametrize("n", [1, 7])
def test_attention_matches_mlx_fused_attention(mask_kind: str, n: int) -> None:
    batch, length = 2, 40
    q, k, v = _qkv(batch, n, length)
    mask = make_mask(mask_kind, batch, n, length)
    ours = cpu_math._attention(q, k, v, 0.125, mask)  # the kernel itself, at any size
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=2e-6)


def test_attention_without_grouped_queries() -> None:
    q, k, v = _qkv(1, 3, 20, heads=4, kv_heads=4)
    np.testing.assert_allclose(np.array(cpu_math._attention(q, k, v, 0.5, "causal")),
                               np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")),
                               atol=2e-6)


def test_the_cpu_backend_routes_swiglu_and_its_caches_attention_only_inside_its_own_forward(monkeypatch) -> None:
    monkeypatch.setattr(cpu_math, "MIN_ELEMENTS", 0)  # the tiny model's arrays are all small
    loaded = loaded_tiny("llama")
    module = sys.modules[type(loaded.model.layers[0].mlp).__module__]
    calls: list[str] = []
    fast_swiglu, fast_attention = cpu_math.swiglu, cpu_math.attention
    monkeypatch.setattr(cpu_math, "swiglu", lambda g, x: (calls.append("swiglu"), fast_swiglu(g, x))[1])
    monkeypatch.setattr(cpu_math, "attention", lambda *a: (calls.append("attention"), fast_attention(*a))[1])
    backend = CpuBackend()
    tokens = mx.array([[3, 14, 15, 92, 65, 35]])

    def caches(kinds):
        kv = SequenceKV.empty(loaded.spec, kinds)
        kv.reserve(tokens.shape[1])
        return kv.caches()

    try:
        backend.attach(loaded.model)
        assert module.swiglu.__wrapped__ is mlx_lm_swiglu
        backend.attach(loaded.model)  # attaching twice wraps once
        assert module.swiglu.__wrapped__ is mlx_lm_swiglu
        plain = loaded.model(tokens, cache=caches(MLX_KINDS))  # mlx-lm's kernels, as its own generation runs
        assert calls == []
        fast = backend.forward(loaded.model, tokens, caches(backend.kinds))
        assert "swiglu" in calls and "attention" in calls
        assert not backend.inside_forward()
        np.testing.assert_allclose(np.array(fast), np.array(plain), atol=1e-4)
        assert (mx.argmax(fast, -1) == mx.argmax(plain, -1)).all().item()
        calls.clear()
        MlxBackend().forward(loaded.model, tokens, caches(MLX_KINDS))
        assert calls == []  # --no-fast-cpu-math
    finally:
        backend.detach(loaded.model)
    assert module.swiglu is mlx_lm_swiglu


def test_two_cpu_backends_on_one_model_family_stack_and_unwind_in_any_order() -> None:
    first, second = loaded_tiny("llama"), loaded_tiny("llama", seed=1)
    module = sys.modules[type(first.model.layers[0].mlp).__module__]
    a, b = CpuBackend(), CpuBackend()
    a.attach(first.model)
    b.attach(second.model)
    assert module.swiglu.__wrapped__.__wrapped__ is mlx_lm_swiglu
    a.detach(first.model)  # the first to attach leaves first: the second's wrapper stays and passes on
    assert module.swiglu.__wrapped__ is not mlx_lm_swiglu
    b.detach(second.model)
    assert module.swiglu is mlx_lm_swiglu and nn.gelu_approx is mlx_gelu_approx


def _blocked_call(mask_kind: str, monkeypatch) -> tuple[mx.array, mx.array, mx.array, object]:
    """A call of 40 queries over 300 keys, with limits set so that it runs in 5 blocks of 8 queries."""
    n, length = 40, 300
    monkeypatch.setattr(cpu_math, "MAX_SCORES", 9 * 10 * length)
    monkeypatch.setattr(cpu_math, "BLOCK_SCORES", 9 * 8 * length)
    return (*_qkv(1, n, length), make_mask(mask_kind, 1, n, length))


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "one-row bool"])
def test_long_calls_run_in_blocks_of_queries_with_the_same_result(mask_kind: str, monkeypatch) -> None:
    q, k, v, mask = _blocked_call(mask_kind, monkeypatch)
    blocks: list[int] = []
    inner = cpu_math._attention
    monkeypatch.setattr(cpu_math, "_attention", lambda qq, *a: (blocks.append(qq.shape[2]), inner(qq, *a))[1])
    ours = cpu_math.attention(q, k, v, 0.125, mask)
    assert blocks == [8, 8, 8, 8, 8]
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=2e-6)


def test_attention_dispatches_by_size(monkeypatch) -> None:
    """Small calls: MLX's attention; decode and short prefill: one kernel call; long prefill: blocks."""
    blocks: list[int] = []
    inner = cpu_math._attention
    monkeypatch.setattr(cpu_math, "_attention", lambda qq, *a: (blocks.append(qq.shape[2]), inner(qq, *a))[1])
    q, k, v = _qkv(1, 1, cpu_math.MIN_ELEMENTS // 9 - 1)
    cpu_math.attention(q, k, v, 0.125, None)
    assert blocks == []
    q, k, v = _qkv(1, 1, cpu_math.MAX_SCORES // 9 + 1)  # one query: never blocked
    cpu_math.attention(q, k, v, 0.125, None)
    q, k, v = _qkv(1, 16, 64)
    cpu_math.attention(q, k, v, 0.125, "causal")
    assert blocks == [1, 16]


@pytest.mark.parametrize("mask_kind", ["causal", "bool"])
def test_blocks_left_in_the_graph_give_the_same_result_without_an_evaluation_per_block(
    mask_kind: str, monkeypatch,
) -> None:
    q, k, v, mask = _blocked_call(mask_kind, monkeypatch)
    evaluated: list[int] = []
    real_eval = mx.eval

    class CountingMx:  # cpu_math's ``mx`` with its evaluations counted
        def __getattr__(self, name: str):
            return getattr(mx, name)

        @staticmethod
        def eval(*arrays):
            evaluated.append(len(arrays))
            real_eval(*arrays)

    monkeypatch.setattr(cpu_math, "mx", CountingMx())
    eager = cpu_math.attention(q, k, v, 0.125, mask)
    assert len(evaluated) == 5  # one per block of 8 queries
    evaluated.clear()
    in_graph = cpu_math.attention(q, k, v, 0.125, mask, evaluate_blocks=False)
    assert evaluated == []
    np.testing.assert_array_equal(np.array(eager), np.array(in_graph))


def test_the_cpu_backend_leaves_a_hybrids_attention_blocks_in_the_graph_and_evaluates_the_others() -> None:
    backend = CpuBackend()
    for kind, expected in (("qwen3_5", HOST_ATTENTION_IN_GRAPH), ("llama", HOST_ATTENTION), ("gemma", HOST_ATTENTION)):
        loaded = loaded_tiny(kind)
        kv = SequenceKV.empty(loaded.spec, backend.kinds_for(loaded.spec))
        attending = [layer for layer in kv.layers if hasattr(layer, "attention")]
        assert attending and all(layer.attention is expected for layer in attending), kind
    assert MlxBackend().kinds_for(loaded_tiny("qwen3_5").spec) is MLX_KINDS
