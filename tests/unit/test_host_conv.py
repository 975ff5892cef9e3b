"""The CPU backend's depthwise convolution loop against MLX's, and where the backend routes it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
import numpy as np
import pytest

from engine.runtime.runner.backends.cpu import host_conv
from engine.runtime.runner.backends.cpu.backend import CpuBackend, CpuOptions
from tests.support.tiny_models import loaded_tiny
from tests.support.warm_ups import wait_for_warm_ups

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _loaded() -> None:
    wait_for_warm_ups()  # (another test's backend may still be loading its loops)
    host_conv.warm_up()


def _conv(channels: int, taps: int, bias: bool = False, dtype: mx.Dtype = mx.float32) -> nn.Conv1d:
    mx.random.seed(channels + taps)
    conv = nn.Conv1d(channels, channels, taps, groups=channels, bias=bias)
    conv.update({k: (v * 3).astype(dtype) for k, v in conv.parameters().items()})
    return conv


@pytest.mark.parametrize("batch, length, channels, taps", [(1, 40, 96, 4), (2, 19, 33, 4), (1, 64, 8, 2),
                                                            (3, 20, 128, 3)])
def test_the_loop_is_mlxs_convolution_to_the_bit(batch: int, length: int, channels: int, taps: int) -> None:
    conv = _conv(channels, taps)
    x = mx.random.normal((batch, length, channels))
    ours = host_conv.depthwise(conv, x)
    assert ours is not None and ours.dtype == mx.float32
    np.testing.assert_array_equal(np.array(ours), np.array(conv(x)))  # not close: equal


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_comes_back_in_its_dtype_equal_to_mlxs(dtype: mx.Dtype) -> None:
    conv = _conv(64, 4, bias=True, dtype=dtype)
    x = mx.random.normal((1, 35, 64)).astype(dtype)
    ours = host_conv.depthwise(conv, x)
    assert ours is not None and ours.dtype == dtype
    np.testing.assert_array_equal(np.array(ours.astype(mx.float32)), np.array(conv(x).astype(mx.float32)))


def test_what_the_loop_leaves_to_mlx() -> None:
    conv = _conv(32, 4)
    assert host_conv.depthwise(conv, mx.zeros((1, host_conv.MIN_STEPS + 2, 32))) is None  # a decode step's few
    assert host_conv.depthwise(conv, mx.zeros((1, host_conv.MIN_STEPS + 3, 32))) is not None
    grouped = nn.Conv1d(32, 32, 4, groups=8, bias=False)
    assert host_conv.depthwise(grouped, mx.zeros((1, 40, 32))) is None
    strided = nn.Conv1d(32, 32, 4, stride=2, groups=32, bias=False)
    assert host_conv.depthwise(strided, mx.zeros((1, 40, 32))) is None
    padded = nn.Conv1d(32, 32, 4, padding=3, groups=32, bias=False)
    assert host_conv.depthwise(padded, mx.zeros((1, 40, 32))) is None


def test_a_chunk_that_finds_the_parallel_gate_taken_leaves_it_to_mlx() -> None:
    from engine.runtime.runner.backends.cpu.parallel_gate import PARALLEL

    conv, x = _conv(32, 4), mx.random.normal((1, 40, 32))
    with PARALLEL:  # another thread inside a parallel loop: numba's work queue must not be entered twice
        assert host_conv.depthwise(conv, x) is None
    assert host_conv.depthwise(conv, x) is not None


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_the_cpu_backend_routes_a_hybrids_prefill_convolutions_only_inside_its_own_forward(family, monkeypatch
                                                                                          ) -> None:
    loaded = loaded_tiny(family)
    calls: list[int] = []
    real = host_conv.depthwise

    def counted(conv, x):
        out = real(conv, x)
        calls.append(x.shape[1] if out is not None else -x.shape[1])
        return out

    monkeypatch.setattr(host_conv, "depthwise", counted)
    original = nn.Conv1d.__call__
    backend = CpuBackend()
    backend.attach(loaded.model)
    wait_for_warm_ups()
    try:
        assert nn.Conv1d.__call__ is not original
        prompt = mx.array([[(i * 7) % 200 + 3 for i in range(40)]])
        ours_cache, theirs_cache = make_prompt_cache(loaded.model), make_prompt_cache(loaded.model)
        ours = backend.forward(loaded.model, prompt, ours_cache)
        taken = [n for n in calls if n > 0]
        assert taken and len(taken) == len(calls)  # every recurrent layer's chunk took the loop
        theirs = loaded.model(prompt, cache=theirs_cache)  # mlx-lm's own call on the same model: MLX's
        assert len(calls) == len(taken)
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-4, atol=1e-4)
        backend.forward(loaded.model, prompt[:, :1], ours_cache)  # a decode step stays in MLX
        assert all(n < 0 for n in calls[len(taken):])
    finally:
        backend.detach(loaded.model)
    assert nn.Conv1d.__call__ is original


def test_the_loop_can_be_turned_off_and_a_model_without_such_layers_is_left_alone() -> None:
    original = nn.Conv1d.__call__
    for kind, options in (("qwen3_5", CpuOptions(depthwise_conv=False)), ("llama", CpuOptions())):
        loaded = loaded_tiny(kind)
        backend = CpuBackend(options)
        backend.attach(loaded.model)
        try:
            assert nn.Conv1d.__call__ is original
        finally:
            backend.detach(loaded.model)
    assert CpuBackend(CpuOptions(depthwise_conv=False)).describe()["host_paths"]["depthwise_conv"] is False


def test_the_engine_waits_for_the_compiled_loops_before_it_says_ready(monkeypatch) -> None:
    """A loop still loading (compiling, on a fresh install) is waited for and reported as the "compiling"
    load stage; a first request would otherwise wait for it (8.4 s against 0.18 s, report s31)."""
    import threading
    import time
    from types import SimpleNamespace

    from engine.bootstrap import await_warm_up
    from engine.runtime.runner.backends.cpu.backend import COMPILING

    released = threading.Event()

    def slow_warm_up() -> None:
        released.wait(5)
        time.sleep(0.2)

    monkeypatch.setattr(host_conv, "warm_up", slow_warm_up)
    backend = CpuBackend()
    loaded = loaded_tiny("qwen3_5")
    backend.attach(loaded.model)
    try:
        reports = []
        released.set()
        await_warm_up(SimpleNamespace(backend=backend), lambda p: reports.append((p.stage, p.done, p.total)))
        assert not [t for t in threading.enumerate() if t.name == "semantic-conv-warmup"]
        assert reports and {stage for stage, _, _ in reports} == {COMPILING}
        assert reports[-1][1] == reports[-1][2] >= 1 and reports[0][1] == 0
        reports.clear()
        await_warm_up(SimpleNamespace(backend=backend), lambda p: reports.append(p))
        assert reports == []  # nothing left to wait for: no stage shown
    finally:
        backend.detach(loaded.model)
