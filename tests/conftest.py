"""Test-suite wiring: markers by directory, a warning when BLAS is slow, and the root logger
put back after each test."""

from __future__ import annotations

import logging
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


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """A test that configures logging (the command line does, run in-process) points the root
    logger at that test's captured stderr; an engine thread of a later test logging there after the
    capture closed printed 'Logging error ... I/O operation on closed file' into the run's output."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


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
