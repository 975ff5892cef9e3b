"""A rank other than 0: its shard of the model and of every agent's cache, and no HTTP.

It loads its shard, runs the same engine as rank 0 in lockstep (replaying
rank 0's inputs), and ends when rank 0 ends the run, writing its shard of
every hot agent to its warm folder as rank 0 does. A signal does not end it
early: ``mlx.launch`` signals every rank at once, and a rank that left before
rank 0's last tick would leave rank 0 waiting and its agents' shards unwritten.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from engine.errors import SemanticError
from engine.settings import Settings

from engine.distributed.world import World

log = logging.getLogger("semantic.distributed")


def serve_follower(settings: Settings, world: World, progress: Any = None) -> int:
    """Exit status: 0 when rank 0 ended the run, 1 when this rank could not start or lost its peers."""
    from engine.bootstrap import release_mlx, start_engine

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _: log.info(
            "%s: %s waits for rank 0 to end the run", signal.Signals(number).name, world.label))
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
