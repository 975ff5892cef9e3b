"""The parts of an engine a test or a benchmark replaces, apart from what every engine is given."""

from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.memory_pressure import MemoryWatch
from engine.runtime.runner.backends import Backend
from engine.runtime.scheduler.scheduler import BatchFactory, sequence_batch_factory


@dataclass(frozen=True, slots=True)
class EngineSeams:
    # How the model is computed (runner/backends/); None: chosen for this device and the settings.
    backend: Backend | None = None
    # The batch the scheduler steps (a test wraps it to make steps fail or hang).
    batch_factory: BatchFactory = sequence_batch_factory
    # The memory watermarks' watch (runtime/memory_pressure.py); None: this machine's, from the settings.
    memory: MemoryWatch | None = None
