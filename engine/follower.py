"""A rank other than 0: its shard of the model and of every agent's cache, and no HTTP.

It loads its shard, runs the same engine as rank 0 in lockstep (replaying
rank 0's inputs), and ends when rank 0 ends the run, writing its shard of
every hot agent to its warm folder as rank 0 does. A signal does not end it
early: ``mlx.launch`` signals every rank at once, and a rank that left before
rank 0's last tick would leave rank 0 waiting and its agents' shards unwritten.
A launcher that is gone (launcher_watch.py) gives rank 0 a bounded time to end
the run before this rank exits on its own.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from engine.errors import SemanticError
from engine.settings import Settings

from engine.distributed.launcher_watch import STOP_SIGNALS, launcher_pid, watch_launcher
from engine.distributed.world import World

log = logging.getLogger("semantic.distributed")

# After the launcher is gone, how long (past rank 0's shutdown grace) rank 0 has to end the run: it
# watches the launcher too, and ending the run together writes every rank's shards.
RANK_0_END_S = 30.0


def serve_follower(settings: Settings, world: World, progress: Any = None) -> int:
    """Exit status: 0 when rank 0 ended the run, 1 when this rank could not start or lost its peers."""
    from engine.bootstrap import release_mlx, start_engine

    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda number, _: log.info(
            "%s: %s waits for rank 0 to end the run", signal.Signals(number).name, world.label))
    launcher = launcher_pid()
    if launcher is not None:
        watch_launcher(launcher, lambda: _end_unless_rank_0_does(world, settings.shutdown_grace_s + RANK_0_END_S))
    try:
        engine = start_engine(settings, progress, world=world)
    except (SemanticError, RuntimeError) as exc:  # RuntimeError: a peer lost, settings that differ
        log.error("%s: could not start: %s", world.label, exc)
        return 1
    log.info("%s: ready, following rank 0 (%s, %d blocks of %s tokens)", world.label, engine.loaded.model_id,
             engine.pool.total_blocks, engine.loaded.spec.block_tokens)
    engine.wait()
    failure = engine.failure
    del engine
    release_mlx()
    if failure is not None:
        log.error("%s: stopped: %s", world.label, failure)
        return 1
    log.info("%s: rank 0 ended the run", world.label)
    return 0


def _end_unless_rank_0_does(world: World, wait_s: float) -> None:
    """The launcher is gone: rank 0 ends the run within ``wait_s`` (it watches the launcher too), or this
    rank exits on its own, non-zero and writing nothing, as a rank that lost its peers does."""
    def deadline() -> None:
        log.error("%s: the launcher is gone and rank 0 did not end the run within %.0f s: exiting without "
                  "writing this rank's shards", world.label, wait_s)
        logging.shutdown()
        os._exit(1)

    log.info("%s: the launcher is gone; waiting up to %.0f s for rank 0 to end the run", world.label, wait_s)
    timer = threading.Timer(wait_s, deadline)
    timer.daemon = True
    timer.start()
