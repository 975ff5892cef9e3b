"""Compute backends of the model runner, and the one place that chooses between them.

``protocol.py``: the interface both implement (``Backend``). ``mlx.py``:
MLX's own kernels (Metal, CUDA, and the CPU with ``--no-fast-cpu-math``).
``cpu/``: the host paths that pay on MLX's CPU device. ``mlx_passes.py``:
the steps through the model's own forward that both run. Nothing under ``cpu/`` is imported unless :func:`choose_backend`
picks it.
"""

from __future__ import annotations

import mlx.core as mx

from engine.runtime.runner.backends.mlx import MlxBackend
from engine.runtime.runner.backends.protocol import Backend


def choose_backend(fast_cpu_math: bool = True) -> Backend:
    """The backend for this process's default device: the CPU's host paths when MLX runs on the CPU and
    ``fast_cpu_math`` (the setting) allows them, else MLX's own kernels."""
    if fast_cpu_math and mx.default_device().type == mx.DeviceType.cpu:
        from engine.runtime.runner.backends.cpu.backend import CpuBackend

        return CpuBackend()
    return MlxBackend()


__all__ = ["Backend", "MlxBackend", "choose_backend"]
