"""Ends a rank whose engine stopped making progress: how a peer killed mid-transfer shows up.

MLX's ring backend raises when a peer's connection closes between
collectives, and the engine then stops with that rank's name. A peer killed
while a collective is in flight can instead leave this rank waiting inside
MLX forever, where no Python exception can reach it. Under lockstep rank 0
ticks the engine loop at least every ``idle_wait_s`` even with nothing to do,
so an engine heartbeat older than ``timeout_s`` means a peer is gone (or a
single step took longer than any should): the rank says so and exits
non-zero. Nothing is torn: cache files are written whole and renamed, and a
rank stuck in a collective is not writing one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("semantic.distributed")


class StallGuard:
    def __init__(self, heartbeat: Callable[[], float], alive: Callable[[], bool], timeout_s: float, who: str,
                 peers: str, exit: Callable[[int], None] = os._exit, poll_s: float = 1.0) -> None:
        self._heartbeat = heartbeat
        self._alive = alive
        self.timeout_s = timeout_s
        self._who = who
        self._peers = peers
        self._exit = exit
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._watch, name="semantic-stall-guard", daemon=True)

    def start(self) -> "StallGuard":
        self._thread.start()
        return self

    def _watch(self) -> None:
        while self._alive():
            quiet = time.monotonic() - self._heartbeat()
            if quiet > self.timeout_s:
                self._give_up(quiet)
                return
            time.sleep(self._poll_s)

    def _give_up(self, quiet: float) -> None:
        log.error("%s: the engine made no progress for %.0f s (rank_timeout_s %g): %s stopped answering; exiting",
                  self._who, quiet, self.timeout_s, self._peers)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        self._exit(1)
