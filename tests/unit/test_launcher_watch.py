"""engine/distributed/launcher_watch.py: which parent is a launcher, and noticing it gone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from engine.distributed.launcher_watch import launcher_pid, watch_launcher


def test_a_parent_that_is_not_mlx_launch_is_not_watched() -> None:
    assert launcher_pid() is None  # pytest's parent: a shell or CI runner


def test_a_child_of_mlx_launch_finds_its_launcher() -> None:
    """A parent whose command line is mlx.launch's (the console script) is the launcher."""
    code = "from engine.distributed.launcher_watch import launcher_pid; import os; print(launcher_pid(), os.getppid())"
    parent = ("import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', "
              f"{code!r}]).returncode)")
    done = subprocess.run([sys.executable, "-c", parent, "mlx.launch", "--backend", "ring"], capture_output=True,
                          text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    found, parent_pid = done.stdout.split()
    assert found == parent_pid, done.stderr


def test_the_watch_fires_once_when_the_parent_changes_and_not_before() -> None:
    fired = threading.Event()
    calls: list[int] = []

    def gone() -> None:
        calls.append(1)
        fired.set()

    stop = watch_launcher(os.getppid(), gone, poll_s=0.01)  # the parent is still there
    assert not fired.wait(0.2)
    stop.set()
    watch_launcher(os.getppid() + 1_000_000, gone, poll_s=0.01)  # not our parent: as if re-parented
    assert fired.wait(5) and calls == [1]
