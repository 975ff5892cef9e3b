"""The suite's own rule: a test over the time limit fails unless a marker says why (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit

pytest_plugins = ["pytester"]

BODY = '''
import time, pytest

def test_quick():
    pass

def test_slow_unmarked():
    time.sleep(0.3)

@pytest.mark.slow(reason="a long real session")
def test_slow_marked():
    time.sleep(0.3)

@pytest.mark.slow
def test_slow_marked_without_a_reason():
    time.sleep(0.3)
'''


def test_a_test_past_the_limit_fails_unless_a_marker_gives_the_reason(pytester: pytest.Pytester,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest("from tests.conftest import *\n")  # the suite's own hooks
    pytester.makepyfile(BODY)
    # (In a subprocess: the textual snapshot plugin keeps session state an in-process run would disturb.)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--time-limit-s", "0.2")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*test_slow_unmarked took 0.3 s, past the 0.2 s*",
                                 "*test_slow_marked_without_a_reason took 0.3 s*"])
