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
    config.addinivalue_line("markers", "solo(reason): a model test that runs alone on the machine, and why (it "
                                       "holds a real client to a time, or measures the whole machine); `make test` "
                                       "runs the other model tests two at a time")


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
        solo = item.get_closest_marker("solo")
        if solo is not None and not solo.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.solo needs reason=... (why it must run alone)")


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
    """Drain MLX streams: work still queued at interpreter exit aborts the process. An xdist worker also sends
    its references' cost to the controller."""
    reference = sys.modules.get("tests.support.reference")
    if reference is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["references"] = vars(reference.STATS)
    if "mlx.core" not in sys.modules:
        return
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize()
    mx.synchronize(generation_stream)


_worker_references: list[dict[str, float]] = []  # under pytest-xdist: each worker's, collected by the controller


def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: keep what a finished worker's references cost (sent in its workeroutput)."""
    stats = getattr(node, "workeroutput", {}).get("references")
    if stats:
        _worker_references.append(stats)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """What plain mlx-lm references cost this run (a fresh machine computes each once), summed over xdist's
    workers: the number that says whether the reference cache pays (docs/development.md)."""
    reference = sys.modules.get("tests.support.reference")
    runs = [*_worker_references, *([vars(reference.STATS)] if reference is not None else [])]
    if any(run["computed"] or run["read"] for run in runs):
        from tests.support.reference import Stats

        total = Stats(**{field: sum(run[field] for run in runs) for field in vars(Stats())})
        terminalreporter.write_line(total.line())
