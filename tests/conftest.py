"""Test-suite wiring: markers by directory, and a warning when BLAS is slow."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        if TESTS / "model" in path.parents and "model" not in item.keywords:
            item.add_marker(pytest.mark.model)
        elif TESTS / "unit" in path.parents and "unit" not in item.keywords:
            item.add_marker(pytest.mark.unit)


def pytest_report_header(config: pytest.Config) -> str:
    preload = os.environ.get("LD_PRELOAD", "")
    if sys.platform.startswith("linux") and "openblas" not in preload:
        return "BLAS: bundled reference BLAS (slow); run through `make test` to preload OpenBLAS"
    return f"BLAS: {'OpenBLAS preloaded' if 'openblas' in preload else 'platform default'}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Drain MLX streams: work still queued at interpreter exit aborts the process."""
    if "mlx.core" not in sys.modules:
        return
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize()
    mx.synchronize(generation_stream)
