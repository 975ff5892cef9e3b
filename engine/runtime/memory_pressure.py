"""Memory watermarks: when the machine runs short of memory, the engine gives way instead of being killed.

The engine samples the memory the system has in use (``platform/memory.py``)
every loop pass, at most ten times a second, and compares it with two
watermarks:

* **soft**: idle agents are cooled and spilled to disk, oldest first, a share
  of the pool each quarter second, and MLX's cache of freed buffers is given
  back; new turns are admitted only as far as idle caches make room for them
  (the pool does not grow past what it held when pressure began), but one
  turn always runs, so nobody starves.
* **hard**: new requests are refused with the protocol's overload error and a
  ``retry-after`` (Anthropic 529 ``overloaded_error``, OpenAI 503); queued
  and running turns go on, and nothing is lost.

Each level is left only once use has fallen a margin below it (2% of the
machine's memory, at least 256 MiB), so a reading hovering at a watermark
does not flap. The watermarks can be changed while the server runs
(``PUT /v1/admin/memory``).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable

from engine.platform.memory import GIB, MemoryReading, default_watermarks, read_memory

SAMPLE_INTERVAL_S = 0.1
RELIEF_INTERVAL_S = 0.25
MIN_MARGIN = GIB // 4


class Pressure(enum.Enum):
    NORMAL = "normal"
    SOFT = "soft"
    HARD = "hard"


@dataclass(frozen=True, slots=True)
class Watermarks:
    """Bytes of system memory in use at which the engine gives way (soft) and refuses new requests (hard)."""

    soft: int
    hard: int

    def __post_init__(self) -> None:
        if not 0 < self.soft <= self.hard:
            raise ValueError(f"memory watermarks need 0 < soft <= hard, got soft {self.soft} and hard {self.hard}")

    @classmethod
    def for_machine(cls, total: int, soft_mb: float | None = None, hard_mb: float | None = None) -> "Watermarks":
        """The settings' watermarks (MiB), each derived from the machine's memory where it is not set."""
        soft, hard = default_watermarks(total)
        if soft_mb is not None:
            soft = int(soft_mb * 2**20)
            hard = hard if hard_mb is not None or hard >= soft else soft  # a soft one set past the default hard
        if hard_mb is not None:
            hard = int(hard_mb * 2**20)
            soft = soft if soft_mb is not None or soft <= hard else hard  # a hard one set below the default soft
        return cls(soft, hard)


class MemoryWatch:
    """The latest reading and the pressure it puts the engine under. Sampled on the engine thread; read
    anywhere (``pressure`` and ``reading`` are replaced whole)."""

    def __init__(self, watermarks: Watermarks, read: Callable[[], MemoryReading] = read_memory) -> None:
        self._read = read
        self._lock = threading.Lock()
        self.watermarks = watermarks
        self.reading: MemoryReading = read()
        # Judged at the first sample (the engine's first loop pass), which then reports a start under pressure
        # as a change, as any other.
        self.pressure = Pressure.NORMAL
        self._sampled = float("-inf")

    def set_watermarks(self, watermarks: Watermarks) -> None:
        with self._lock:
            self.watermarks = watermarks
            self._sampled = float("-inf")  # judged again at the next sample

    def sample(self, now: float | None = None) -> Pressure | None:
        """Read memory if the last reading is old enough; the new pressure when it changed, else None."""
        now = time.monotonic() if now is None else now
        if now - self._sampled < SAMPLE_INTERVAL_S:
            return None
        self._sampled = now
        self.reading = self._read()
        level = self._level(self.reading)
        if level is self.pressure:
            return None
        self.pressure = level
        return level

    def _level(self, reading: MemoryReading) -> Pressure:
        with self._lock:
            marks = self.watermarks
        used, margin = reading.system_used, max(reading.system_total // 50, MIN_MARGIN)
        current = self.pressure
        if used >= marks.hard or (current is Pressure.HARD and used >= marks.hard - margin):
            return Pressure.HARD
        if used >= marks.soft or (current is not Pressure.NORMAL and used >= marks.soft - margin):
            return Pressure.SOFT
        return Pressure.NORMAL

    def describe(self) -> dict[str, object]:
        """For /v1/stats and the workbench: the reading, the watermarks and the pressure, in bytes."""
        r, marks = self.reading, self.watermarks
        return {"pressure": self.pressure.value, "system_total_bytes": r.system_total,
                "system_used_bytes": r.system_used, "system_available_bytes": r.system_available,
                "process_bytes": r.process, "mlx_active_bytes": r.mlx_active, "mlx_cache_bytes": r.mlx_cache,
                "soft_watermark_bytes": marks.soft, "hard_watermark_bytes": marks.hard}
