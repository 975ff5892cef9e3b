"""What the engine does about the machine's memory (the watermarks are runtime/memory_pressure.py's).

Each loop pass samples memory. Past the soft watermark, new turns may bring
the pool no higher than it stood when pressure began (admission's ceiling),
and four times a second MLX's free buffers go back and an eighth of the pool's
idle caches are cooled or spilled; past the hard one, new requests are
refused until use falls. Not under lockstep (``watch`` None): every rank
would have to give way at the same point of its loop, and each reads its own
machine.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from engine.domain.block_pool import BlockPool
from engine.domain.event_log import EventKind, EventLog
from engine.errors import EngineUnavailableError, MemoryPressureError
from engine.runtime.memory_pressure import RELIEF_INTERVAL_S, MemoryWatch, Pressure, Watermarks
from engine.runtime.scheduler.admission import Admission
from engine.runtime.tiers.manager import TierManager

_SAID = {Pressure.NORMAL: "memory back to normal: the pool may grow again",
         Pressure.SOFT: "memory past the soft watermark: cooling and spilling idle agents, admitting new turns "
                        "as memory allows",
         Pressure.HARD: "memory past the hard watermark: refusing new requests until it falls"}


class MemoryPolicy:
    def __init__(self, watch: MemoryWatch | None, pool: BlockPool, tiers: TierManager, events: EventLog) -> None:
        self.watch = watch
        self.pool = pool
        self.tiers = tiers
        self.events = events
        self._relieved = 0.0

    def refuse_under_hard_pressure(self) -> None:
        """Any thread: raise the overload error a new request gets past the hard watermark."""
        watch = self.watch
        if watch is not None and watch.pressure is Pressure.HARD:
            used, hard = watch.reading.system_used, watch.watermarks.hard
            raise MemoryPressureError(f"the machine is short of memory: {used / 2**30:.1f} GiB in use, past the "
                                      f"hard watermark of {hard / 2**30:.1f} GiB (memory_hard_limit_mb); running "
                                      "turns go on, new ones are refused until it falls; retry shortly")

    def set_watermarks(self, watermarks: Watermarks) -> None:
        """New watermarks from now on (any thread); judged at the engine's next sample."""
        if self.watch is None:
            raise EngineUnavailableError("memory watermarks are off in this process (a rank of a sharded model)")
        self.watch.set_watermarks(watermarks)

    def each_pass(self, admission: Admission, running: set[str]) -> None:
        """Engine thread, once a loop pass: sample memory; under pressure, limit what new turns may add and
        send idle caches away (never those of ``running`` agents)."""
        watch = self.watch
        if watch is None:
            return
        now = time.monotonic()
        changed = watch.sample(now)
        if changed is not None:
            reading, marks = watch.reading, watch.watermarks
            where = (f"{reading.system_used / 2**30:.1f} GiB in use of {reading.system_total / 2**30:.1f} "
                     f"(soft {marks.soft / 2**30:.1f}, hard {marks.hard / 2**30:.1f}); this process "
                     f"{reading.process / 2**30:.2f} GiB, MLX {reading.mlx_active / 2**30:.2f} GiB")
            level = logging.INFO if changed is Pressure.NORMAL else logging.WARNING
            self.events.emit(EventKind.INFO, f"{_SAID[changed]} ({where})", level=level)
            if changed is Pressure.NORMAL:
                admission.ceiling = None
            elif admission.ceiling is None:
                admission.ceiling = self.pool.used_blocks
        if watch.pressure is not Pressure.NORMAL and now - self._relieved >= RELIEF_INTERVAL_S:
            self._relieved = now
            self._relieve(admission, running)

    def _relieve(self, admission: Admission, running: set[str]) -> None:
        """Under pressure: give MLX's free buffers back, and send an eighth of the pool's idle caches away."""
        mx.clear_cache()
        pool = self.pool
        self.tiers.make_room(pool.free_blocks + max(1, pool.used_blocks // 8), running, reason="memory pressure")
        if admission.ceiling is not None:
            admission.ceiling = min(admission.ceiling, pool.used_blocks)
