"""The CPU backend's gated-delta prefill loop against mlx-lm's steps, and where the backend routes it."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.gated_delta as gated_delta
from mlx_lm.models.cache import make_prompt_cache
import numpy as np
import pytest

from engine.runtime.runner.backends.cpu import host_gated_delta
from engine.runtime.runner.backends.cpu.backend import CpuBackend, CpuOptions
from tests.support.tiny_models import loaded_tiny
from tests.support.warm_ups import wait_for_warm_ups

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_warm_up_holds_the_gate() -> None:
    wait_for_warm_ups()  # (another test's backend may still be loading its loops)


def _inputs(batch: int, steps: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
            dtype: mx.Dtype = mx.float32):
    mx.random.seed(steps)
    q = (mx.random.normal((batch, steps, key_heads, key_dim)) * 0.1).astype(dtype)
    k = (mx.random.normal((batch, steps, key_heads, key_dim)) * 0.1).astype(dtype)
    v = mx.random.normal((batch, steps, value_heads, value_dim)).astype(dtype)
    g = mx.exp(-mx.abs(mx.random.normal((batch, steps, value_heads))))
    beta = mx.sigmoid(mx.random.normal((batch, steps, value_heads))).astype(dtype)
    state = mx.random.normal((batch, value_heads, value_dim, key_dim)) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("shape", [(1, 40, 4, 4, 32, 16), (2, 24, 2, 4, 16, 32), (1, 17, 1, 3, 8, 8)])
def test_the_loop_computes_mlx_lms_steps(shape: tuple[int, ...]) -> None:
    q, k, v, g, beta, state = _inputs(*shape)
    held = np.array(state)
    ours = host_gated_delta.steps(q, k, v, g, beta, state)
    assert ours is not None
    theirs = gated_delta.gated_delta_ops(q, k, v, g, beta, state)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(state), held)  # the state passed in (a snapshot's) is untouched


def test_bfloat16_activations_come_back_in_their_dtype_with_a_float32_state() -> None:
    q, k, v, g, beta, state = _inputs(1, 20, 2, 2, 16, 16, mx.bfloat16)
    y, new_state = host_gated_delta.steps(q, k, v, g, beta, state)
    ref_y, ref_state = gated_delta.gated_delta_ops(q, k, v, g, beta, state)
    assert y.dtype == mx.bfloat16 and new_state.dtype == mx.float32
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(ref_y.astype(mx.float32)), atol=1e-2)
    np.testing.assert_allclose(np.array(new_state), np.array(ref_state), rtol=1e-4, atol=1e-5)


def test_what_the_loop_leaves_to_mlx_lm() -> None:
    q, k, v, g, beta, state = _inputs(1, host_gated_delta.MIN_STEPS - 1, 2, 2, 8, 8)
    assert host_gated_delta.steps(q, k, v, g, beta, state) is None  # a decode step or a short verify
    q, k, v, g, beta, state = _inputs(1, 20, 2, 2, 8, 8)
    assert host_gated_delta.steps(q, k, v, g, beta, state, mx.ones((1, 20), dtype=mx.bool_)) is None  # padded
    per_channel = mx.broadcast_to(g[..., None], (*g.shape, 8))  # Kimi's gates
    assert host_gated_delta.steps(q, k, v, per_channel, beta, state) is None


def test_the_cpu_backend_routes_a_hybrids_prefill_chunks_only_inside_its_own_forward(monkeypatch) -> None:
    loaded = loaded_tiny("qwen3_5")
    calls: list[int] = []
    real = host_gated_delta.steps

    def counted(q, *rest):
        out = real(q, *rest)
        calls.append(q.shape[1] if out is not None else -q.shape[1])
        return out

    monkeypatch.setattr(host_gated_delta, "steps", counted)
    original = gated_delta.gated_delta_ops
    backend = CpuBackend()
    backend.attach(loaded.model)
    wait_for_warm_ups()
    try:
        assert gated_delta.gated_delta_ops is not original
        prompt = mx.array([[(i * 7) % 200 + 3 for i in range(40)]])
        ours_cache, theirs_cache = make_prompt_cache(loaded.model), make_prompt_cache(loaded.model)
        ours = backend.forward(loaded.model, prompt, ours_cache)
        recurrent_layers = len(calls)
        assert recurrent_layers > 0 and set(calls) == {40}
        theirs = loaded.model(prompt, cache=theirs_cache)  # mlx-lm's own call on the same model: its steps
        assert len(calls) == recurrent_layers
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-4, atol=1e-4)
        backend.forward(loaded.model, prompt[:, :1], ours_cache)  # a decode step stays in MLX
        assert len(calls) == recurrent_layers
    finally:
        backend.detach(loaded.model)
    assert gated_delta.gated_delta_ops is original


def test_the_loop_can_be_turned_off() -> None:
    loaded = loaded_tiny("qwen3_5")
    original = gated_delta.gated_delta_ops
    backend = CpuBackend(CpuOptions(recurrence=False))
    backend.attach(loaded.model)
    try:
        assert gated_delta.gated_delta_ops is original
        assert backend.describe()["host_paths"]["recurrence"] is False
    finally:
        backend.detach(loaded.model)


def test_a_model_without_gated_delta_layers_is_left_alone() -> None:
    loaded = loaded_tiny("llama")
    original = gated_delta.gated_delta_ops
    backend = CpuBackend()
    backend.attach(loaded.model)
    try:
        assert gated_delta.gated_delta_ops is original
    finally:
        backend.detach(loaded.model)


def test_a_chunk_that_finds_the_parallel_gate_taken_leaves_it_to_mlx_lm() -> None:
    from engine.runtime.runner.backends.cpu.parallel_gate import PARALLEL

    q, k, v, g, beta, state = _inputs(1, 20, 2, 2, 8, 8)
    with PARALLEL:  # another thread inside a parallel loop: numba's work queue must not be entered twice
        assert host_gated_delta.steps(q, k, v, g, beta, state) is None
    assert host_gated_delta.steps(q, k, v, g, beta, state) is not None
