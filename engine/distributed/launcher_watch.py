"""Noticing that ``mlx.launch`` is gone, so no rank outlives its launcher.

Measured (platform.md): SIGTERM to ``mlx.launch -n 3 --backend ring -- semantic
--serve`` ends the launcher only; its ranks are re-parented to init and keep
running, rank 0 still serving HTTP and the followers spinning in the ring
collective. ``mlx.launch`` starts a local rank as ``bash -c '... exec CMD'``,
so the rank's parent is the launcher's own Python process: when the parent
changes, the launcher is gone. (A remote rank runs under ``ssh -tt``; the
launcher's end closes that terminal and the rank gets SIGHUP, which the
servers handle like SIGTERM.)

Ranks started by hand are not watched: their parent is a shell, and a user
who starts a rank with ``nohup`` means it to outlive that shell.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

import psutil

log = logging.getLogger("semantic.distributed")

# How the launcher shows in its process's command line (`mlx.launch` is a console script of mlx).
_LAUNCHER_MARKS = ("mlx.launch", "mlx/_distributed_utils/launch", "mlx_launch")
POLL_S = 1.0
# What stops a server or a rank: Ctrl+C, a process manager's SIGTERM, and SIGHUP (a closed terminal,
# or the ssh session of a remote rank ending with its launcher).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def launcher_pid() -> int | None:
    """The parent's pid when the parent is ``mlx.launch``; None otherwise (alone, by hand, a test)."""
    parent = os.getppid()
    try:
        command = " ".join(psutil.Process(parent).cmdline())
    except (psutil.Error, OSError):
        return None
    return parent if any(mark in command for mark in _LAUNCHER_MARKS) else None


def watch_launcher(pid: int, on_gone: Callable[[], None], poll_s: float = POLL_S) -> threading.Event:
    """Call ``on_gone`` once, from a daemon thread, when the launcher ``pid`` is no longer this process's
    parent (it ended and the process was re-parented). Set the returned event to stop watching."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            if os.getppid() != pid:
                log.warning("the launcher (mlx.launch, pid %d) is gone: stopping this rank", pid)
                on_gone()
                return

    threading.Thread(target=watch, name="semantic-launcher-watch", daemon=True).start()
    return stop
