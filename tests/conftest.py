"""Test-suite wiring: markers by directory, a time limit per test, a warning when BLAS is slow, and the
root logger put back after each test."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


# A test whose call takes longer fails unless a marker says why it may (slow(reason=...)): the suite stays
# under its half hour without anyone watching (docs/development.md).
TIME_LIMIT_S = 60.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--time-limit-s", type=float, default=TIME_LIMIT_S,
                     help=f"seconds a test may take without @pytest.mark.slow(reason=...) (default {TIME_LIMIT_S:.0f})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow(reason): a test allowed to take longer than "
                                       f"{TIME_LIMIT_S:.0f} s, and why (a real CLI session, a long prefill)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Before ``-m`` selects (tryfirst): every test under tests/unit is a unit test, under tests/model a model test,
    so ``make test-unit`` runs the whole of tests/unit."""
    for item in items:
        path = Path(str(item.fspath))
        if TESTS / "model" in path.parents and "model" not in item.keywords:
            item.add_marker(pytest.mark.model)
        elif TESTS / "unit" in path.parents and "unit" not in item.keywords:
            item.add_marker(pytest.mark.unit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    limit = item.config.getoption("--time-limit-s")
    if call.when != "call" or not report.passed or call.duration <= limit:
        return
    marker = item.get_closest_marker("slow")
    if marker is None or not marker.kwargs.get("reason"):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {call.duration:.1f} s, past the {limit:g} s a test may take "
                           "without @pytest.mark.slow(reason=...) saying why (tests/conftest.py)")


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
