"""The two-rank tests' Ctrl+C: a rank that keeps running fails them; a launcher that hangs after its
ranks are gone (mlx.launch's own bug, see ``Launched.stop``) does not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.distributed_run import Launched

# A stand-in launcher: it ignores Ctrl+C (as a hung mlx.launch does) and starts one "rank" that either
# exits at Ctrl+C, as ranks do, or ignores it too (an ignored signal stays ignored across exec, so
# the exiting one puts Python's handler back).
LAUNCHER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
handler = "signal.SIG_IGN" if sys.argv[1] == "stuck" else "signal.default_int_handler"
rank = f"import signal, time; signal.signal(signal.SIGINT, {handler}); print('ready', flush=True); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", rank])
time.sleep(600)
"""


def started(rank: str) -> Launched:
    process = subprocess.Popen([sys.executable, "-c", LAUNCHER, rank], text=True, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    launched = Launched(process, "http://unused", ranks=2)
    launched.start_reading()
    return launched


def test_a_launcher_left_hanging_by_ranks_that_all_exited_is_killed_and_not_blamed_on_them() -> None:
    assert started("exits").stop(timeout_s=30, launcher_grace_s=1) == -9


def test_a_rank_still_running_after_ctrl_c_fails_the_stop_and_is_listed() -> None:
    with pytest.raises(AssertionError, match="still running 3 s after Ctrl"):
        started("stuck").stop(timeout_s=3, launcher_grace_s=1)
