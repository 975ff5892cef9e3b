"""The compute path is decided by one backend object: chosen once, nothing global left behind, and on Metal,
CUDA or ``--no-fast-cpu-math`` none of the CPU path's modules is even imported."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.nn.layers.activations as activations
import pytest

# The CPU path's modules, loaded now so that their globals are part of what is watched.
from engine.runtime.runner.backends.cpu import host_kernels, linear_kernel, top_k_kernel  # noqa: F401
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turns
from engine.runtime.runner.backends import Backend, MlxBackend, choose_backend
from engine.runtime.runner.backends.cpu.backend import CpuBackend
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.engine_seams import EngineSeams
from tests.support.engine_settings import engine_settings
from tests.support.byte_tokenizer import BOS
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CPU_PACKAGE = "engine.runtime.runner.backends.cpu"


def global_state(model: nn.Module) -> dict[str, int]:
    """What a compute path could switch: every module-level name of the engine's runtime and of mlx-lm's model
    modules, ``mlx.nn``'s activations (the GELU module's too), MLX's fused attention, and the classes of the
    model's layers (by identity)."""
    state: dict[str, int] = {}
    for name, module in list(sys.modules.items()):
        if isinstance(module, types.ModuleType) and name.startswith(("engine.runtime", "mlx_lm.models")):
            for attr, value in vars(module).items():
                if not attr.startswith("__"):
                    state[f"{name}.{attr}"] = id(value)
    state["mlx.nn.gelu_approx"] = id(nn.gelu_approx)
    state["mlx.nn.layers.activations.gelu_approx"] = id(activations.gelu_approx)
    state["mlx.nn.layers.activations.gelu_fast_approx"] = id(activations.gelu_fast_approx)
    state["mlx.nn.silu"] = id(nn.silu)
    state["mx.fast.scaled_dot_product_attention"] = id(mx.fast.scaled_dot_product_attention)
    for path, layer in model.named_modules():
        state[f"model.{path}.__class__"] = id(type(layer))
    return state


def prompts() -> list[GenerationRequest]:
    return [GenerationRequest(f"a{i}", (BOS, *(f"agent {i} writes a line. " * (2 + i)).encode()), 24)
            for i in range(3)]


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_each_backend_runs_a_turn_and_leaves_no_global_state_behind(kind: str) -> None:
    """An engine per backend on the same model object: the same greedy tokens, and afterwards every module
    global, ``mlx.nn``'s activations and the model's layer classes are what they were before."""
    loaded = loaded_tiny(kind)
    # Found once per process, kept after (a cache, not a switch): found before the first state is taken.
    from engine.runtime.runner.backends.cpu import host_verify_attention
    host_verify_attention.one_blas_thread()
    modules_before = set(sys.modules)
    before = global_state(loaded.model)
    outputs = []
    for backend in (MlxBackend(), CpuBackend(), MlxBackend()):
        engine = Engine(loaded, engine_settings(64 << 20, 8, 32), seams=EngineSeams(backend=backend))
        engine.start()
        try:
            assert engine.backend is backend
            outputs.append([r.tokens for r in run_turns(engine, prompts())])
        finally:
            engine.stop()
        after = global_state(loaded.model)
        # A module first imported during the run (a compiled loop's, by its background warm-up) is new state,
        # not switched state: its names, and its binding on its package, are left out.
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)
                         and k not in sys.modules.keys() - modules_before
                         and k.rpartition(".")[0] not in sys.modules.keys() - modules_before)
        assert changed == [], f"{backend.name} left global state changed: {changed}"
    assert outputs[0] == outputs[1] == outputs[2]


def test_both_backends_implement_the_protocol_and_neither_derives_from_the_other() -> None:
    """Each backend class defines every method of ``Backend`` itself (none inherited from a concrete
    backend), with the protocol's parameters, and neither class is a base of the other."""
    import inspect

    members = [name for name in dir(Backend) if not name.startswith("_") and callable(getattr(Backend, name))]
    assert {"decode", "verify", "forward", "attach", "top_k_of_logits"} <= set(members)
    for cls in (MlxBackend, CpuBackend):
        assert isinstance(cls(), Backend)
        assert cls.__mro__ == (cls, object), f"{cls.__name__} derives from {cls.__mro__[1:-1]}"
        for name in members:
            assert name in vars(cls), f"{cls.__name__} does not define {name}"
            assert (list(inspect.signature(vars(cls)[name]).parameters)
                    == list(inspect.signature(getattr(Backend, name)).parameters)), f"{cls.__name__}.{name}"


def test_the_device_and_the_setting_choose_the_backend() -> None:
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    assert type(choose_backend(fast_cpu_math=True)) is (CpuBackend if on_cpu else MlxBackend)
    assert type(choose_backend(fast_cpu_math=False)) is MlxBackend


@pytest.mark.parametrize("fast_cpu_math", [False, True])
def test_without_the_cpu_path_none_of_its_modules_is_imported(fast_cpu_math: bool) -> None:
    """An engine run as the settings build it: with ``fast_cpu_math`` off, nothing under backends/cpu/ loads
    (numba neither); on (the default here), it does."""
    code = f"""
import sys
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.runtime.engine_thread.sync_client import run_turns
from engine.domain.requests import GenerationRequest
from tests.support.byte_tokenizer import BOS
from tests.support.tiny_models import loaded_tiny

engine = Engine(loaded_tiny("llama"), engine_settings(64 << 20, 4, 32, fast_cpu_math={fast_cpu_math}))
engine.start()
run_turns(engine, [GenerationRequest(f"a{{i}}", (BOS, *b"hello there"), 8) for i in range(2)])
engine.stop()
print(sorted(m for m in sys.modules if m.startswith("{CPU_PACKAGE}") or m == "numba"))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = eval(out.stdout.strip().splitlines()[-1])
    if not fast_cpu_math:
        assert loaded == []
    elif mx.default_device().type == mx.DeviceType.cpu:
        assert f"{CPU_PACKAGE}.backend" in loaded and f"{CPU_PACKAGE}.host_kv" in loaded
