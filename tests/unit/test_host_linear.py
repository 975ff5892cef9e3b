"""A decode step's few-row linear layers through one compiled pass over the weights (host_linear, linear_kernel)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.runner.backends.cpu import host_linear, linear_kernel
from engine.runtime.runner.backends.cpu.backend import CpuBackend, CpuOptions
from tests.support.tiny_models import tiny_llama

pytestmark = pytest.mark.unit


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 37), outputs=st.integers(1, 37), inner=st.integers(1, 70), shares=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_the_pass_equals_x_times_weights_transposed(rows: int, outputs: int, inner: int, shares: int, seed: int) -> None:
    """Every output, with blocks of four weight rows by four rows of ``x``, tails of both, and shares of any size
    (some empty)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    w = rng.standard_normal((outputs, inner)).astype(np.float32)
    out = np.full((rows, outputs), np.nan, dtype=np.float32)
    linear_kernel.times_transposed(x, w, out, shares)
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


def test_a_step_on_the_host_takes_the_pass_up_to_its_own_row_limit() -> None:
    """A layer inside MLX's forward stops at MAX_ROWS (it evaluates its input first); a step run whole on the
    host (a verification's tokens, 16 agents) goes on to HOST_STEP_MAX_ROWS, then BLAS (None)."""
    w = np.ones((5, 8), np.float32)
    assert host_linear.times(np.ones((host_linear.MAX_ROWS + 1, 8), np.float32), w) is None
    wide = np.ones((host_linear.HOST_STEP_MAX_ROWS, 8), np.float32)
    np.testing.assert_array_equal(host_linear.times(wide, w, host_linear.HOST_STEP_MAX_ROWS), wide @ w.T)
    too_wide = np.ones((host_linear.HOST_STEP_MAX_ROWS + 1, 8), np.float32)
    assert host_linear.times(too_wide, w, host_linear.HOST_STEP_MAX_ROWS) is None


@pytest.fixture
def backend():
    backend = CpuBackend()
    yield backend
    backend.close()


def inside(backend: CpuBackend, call, x: mx.array) -> mx.array:
    """``call(x)`` inside the backend's forward pass, as the engine's batch runs the model."""
    return backend.forward(lambda inputs, cache: call(inputs), x, None)


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each call of the compiled pass."""
    calls: list[int] = []
    real = linear_kernel.times_transposed
    monkeypatch.setattr(linear_kernel, "times_transposed", lambda x, *rest: calls.append(x.shape[0]) or real(x, *rest))
    return calls


def linear(bias: bool, backend: CpuBackend) -> nn.Linear:
    layer = nn.Linear(48, 20, bias=bias)
    mx.eval(layer.parameters())
    host_linear.swap_in(layer, backend)
    assert isinstance(layer, host_linear.HostLinear) and layer.router is backend
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_inside_the_backends_forward_up_to_16_rows_take_the_pass(backend, passes: list[int], bias: bool) -> None:
    layer = linear(bias, backend)
    x = mx.array(np.random.default_rng(0).standard_normal((16, 1, 48)).astype(np.float32))  # 16 one-token rows
    got = inside(backend, layer, x)
    expected = x @ layer.weight.T + (layer.bias if bias else 0)
    assert got.shape == (16, 1, 20) and passes == [16]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    wider = mx.ones((host_linear.MAX_ROWS + 1, 48))
    np.testing.assert_allclose(np.asarray(inside(backend, layer, wider)),
                               np.asarray(wider @ layer.weight.T + (layer.bias if bias else 0)), rtol=1e-6)
    assert passes == [16]  # 17 rows: MLX's matmul (past what was measured to pay)
    chunk = mx.array(np.random.default_rng(1).standard_normal((2, 4, 48)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(inside(backend, layer, chunk)),
                               np.asarray(chunk @ layer.weight.T + (layer.bias if bias else 0)), rtol=1e-5, atol=1e-5)
    assert passes == [16]  # two rows of 4 tokens each (a short chunk, a speculative step): MLX's matmul, faster there


def test_outside_the_backends_forward_and_for_other_dtypes_mlx_computes(backend, passes: list[int]) -> None:
    layer = linear(True, backend)
    x = mx.ones((1, 48))
    plain = nn.Linear(48, 20)
    plain.update(layer.parameters())
    assert np.array_equal(np.asarray(layer(x)), np.asarray(plain(x)))  # mlx-lm's own generation, the tests' references
    layer.set_dtype(mx.float16)
    assert inside(backend, layer, x.astype(mx.float16)).dtype == mx.float16
    assert passes == []
    linear_off = linear(True, CpuBackend(CpuOptions(linear_pass=False)))
    inside(linear_off.router, linear_off, x)
    assert passes == []


def test_a_tied_output_layer_takes_the_pass(backend, passes: list[int]) -> None:
    model = tiny_llama()
    host_linear.swap_in(model, backend)
    embed = model.model.embed_tokens
    x = mx.array(np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(inside(backend, embed.as_linear, x)), np.asarray(x @ embed.weight.T),
                               rtol=1e-5, atol=1e-5)
    assert passes == [3]


def test_attaching_swaps_only_the_exact_classes_keeps_the_parameters_and_detaching_swaps_back(backend) -> None:
    class Adapted(nn.Linear):  # a LoRA-style subclass keeps its own __call__
        pass

    model = tiny_llama()
    before = {k: np.asarray(v) for k, v in _flat(model.parameters())}
    model.extra = Adapted(4, 4)
    swapped = host_linear.swap_in(model, backend)
    assert swapped == 2 * 7 + 1  # two layers of seven projections, and the embedding
    assert type(model.extra) is Adapted
    after = dict(_flat(model.parameters()))
    assert all(np.array_equal(before[k], np.asarray(after[k])) for k in before)
    host_linear.swap_out(model, backend)
    classes = {type(m) for _, m in model.named_modules()}
    assert not any(issubclass(c, (host_linear.HostLinear, host_linear.HostEmbedding)) for c in classes)
    assert nn.Linear in classes and nn.Embedding in classes


def _flat(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix, tree


def test_a_pass_that_does_not_load_leaves_the_layers_in_mlx(backend, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    backend._load(host_linear.warm_up, "_linear_ok", "decode's linear layers")
    assert backend._linear_ok

    class Broken:  # a dispatcher that cannot compile (warm_up compiles, then runs)
        def compile(self, *args):
            raise RuntimeError("no compiler here")

        def __call__(self, *args):
            raise RuntimeError("no compiler here")

    monkeypatch.setattr(linear_kernel, "times_transposed", Broken())
    with caplog.at_level("WARNING", logger="semantic.engine"):
        backend._load(host_linear.warm_up, "_linear_ok", "decode's linear layers")
    assert not backend._linear_ok
    assert "linear layers: MLX runs it instead" in caplog.text and "no compiler here" in caplog.text
    layer = linear(False, backend)
    x = mx.ones((1, 48))
    np.testing.assert_allclose(np.asarray(inside(backend, layer, x)), np.asarray(x @ layer.weight.T), rtol=1e-6)


def test_a_second_thread_inside_the_pass_takes_mlx_instead_of_waiting(backend, passes: list[int]) -> None:
    """numba's work-queue threading layer (where OpenMP is missing) must not be entered twice at once."""
    layer = linear(False, backend)
    x = mx.ones((2, 48))
    with host_linear._busy:
        got = inside(backend, layer, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ layer.weight.T), rtol=1e-6)
    assert passes == []
    inside(backend, layer, x)
    assert passes == [2]
