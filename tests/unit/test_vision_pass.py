"""The CPU backend's vision pass: a vision tower's attention and GELU take the host paths inside it only.

mlx-vlm's towers call ``mx.fast.scaled_dot_product_attention`` and ``nn.GELU`` (whose "precise" and "tanh"
both call ``mlx.nn.layers.activations.gelu_approx``); the backend wraps both names while a model is attached
and takes them only inside :meth:`CpuBackend.vision_pass` on the calling thread. Outside it (the text model's
forward, mlx-vlm's own generation in the tests' references) MLX's kernels run unchanged.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.runtime.runner.backends.cpu import backend as cpu_backend
from engine.runtime.runner.backends.cpu import cpu_math
from engine.runtime.runner.backends.cpu.backend import CpuBackend, CpuOptions
from engine.runtime.runner.backends.mlx import MlxBackend
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit


class Counting:
    def __init__(self, function):
        self.function = function
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.function(*args)


@pytest.fixture
def attached(monkeypatch: pytest.MonkeyPatch):
    gelu = Counting(cpu_math.gelu_approx)
    attention = Counting(cpu_backend.HOST_ATTENTION.sdpa)
    monkeypatch.setattr(cpu_math, "gelu_approx", gelu)
    monkeypatch.setattr(cpu_backend, "HOST_ATTENTION", type("Spy", (), {"sdpa": staticmethod(attention)})())
    model = loaded_tiny("llama").model
    backend = CpuBackend()
    backend.attach(model)
    yield backend, gelu, attention
    backend.detach(model)
    backend.close()


def tower_ops() -> tuple[mx.array, mx.array]:
    """What a tower's layer calls: nn.GELU over an MLP's activations and MLX's attention over its patches."""
    x = mx.random.normal((64, 256), key=mx.random.key(1))  # past cpu_math.MIN_ELEMENTS
    q, k, v = (mx.random.normal((1, 2, 48, 16), key=mx.random.key(i)) for i in range(3))
    gelu = nn.GELU(approx="precise")(x)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=None)
    mx.eval(gelu, out)
    return gelu, out


def test_inside_the_pass_the_tower_takes_the_host_paths_with_the_same_arithmetic(attached) -> None:
    backend, gelu, attention = attached
    plain = tower_ops()
    assert gelu.calls == attention.calls == 0
    with backend.vision_pass():
        fast = tower_ops()
    assert gelu.calls == 1 and attention.calls == 1
    # cpu_math's exp is within 2 ulp of MLX's; the sums are ordered differently.
    for ours, theirs in zip(fast, plain):
        assert mx.allclose(ours, theirs, rtol=1e-5, atol=1e-6).item()
    # Small attention inside the host path falls back to MLX's own kernel without re-entering the wrapper.
    with backend.vision_pass():
        q = mx.ones((1, 1, 2, 4))
        mx.eval(mx.fast.scaled_dot_product_attention(q, q, q, scale=1.0))
    assert attention.calls == 2


def test_the_pass_belongs_to_its_thread_and_ends_with_it(attached) -> None:
    backend, gelu, attention = attached
    seen: list[int] = []
    with backend.vision_pass():
        worker = threading.Thread(target=lambda: (tower_ops(), seen.append(attention.calls)))
        worker.start()
        worker.join()
    assert seen == [0] and gelu.calls == 0
    tower_ops()
    assert attention.calls == 0


def test_off_by_option_and_on_other_backends() -> None:
    model = loaded_tiny("llama").model
    original = mx.fast.scaled_dot_product_attention
    backend = CpuBackend(CpuOptions(vision_tower=False))
    backend.attach(model)
    try:
        assert mx.fast.scaled_dot_product_attention is original
    finally:
        backend.detach(model)
        backend.close()
    with MlxBackend().vision_pass():  # nothing to take: MLX's kernels
        assert mx.fast.scaled_dot_product_attention is original


def test_inside_a_compiled_helper_the_attention_is_mlxs(attached, monkeypatch) -> None:
    """mlx-vlm compiles some of its towers' helpers (``chunked_attention``): the host attention evaluates, which a
    trace cannot, so the call is MLX's there, with the same result."""
    backend, _, attention = attached
    monkeypatch.setattr(cpu_math, "MAX_SCORES", 64)  # the compiled softmax rows' path, which evaluates

    @mx.compile
    def helper(q: mx.array) -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, q, q, scale=0.5)

    q = mx.random.normal((1, 2, 64, 16), key=mx.random.key(3))
    from engine.runtime.runner.backends.cpu import host_softmax
    host_softmax.warm_up()
    with backend.vision_pass():
        traced = helper(q)
    assert mx.allclose(traced, mx.fast.scaled_dot_product_attention(q, q, q, scale=0.5)).item()
    assert attention.calls == 1  # tried, declined
