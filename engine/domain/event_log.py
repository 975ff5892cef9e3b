"""Engine events for humans (the TUI's log pane, --serve's logs).

A bounded ring buffer with sequence numbers: readers ask for everything after
the last number they saw, so a slow reader never blocks the engine.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger("semantic.engine")


class EventKind(str, enum.Enum):
    LOAD = "load"
    ADMIT = "admit"
    FINISH = "finish"
    EVICT = "evict"
    RESTORE = "restore"
    DISCARD = "discard"
    SHARE = "share"
    SWAP = "swap"
    ERROR = "error"
    INFO = "info"


@dataclass(frozen=True, slots=True)
class LogEvent:
    seq: int
    at: float
    kind: EventKind
    message: str
    agent_id: str | None = None
    level: int = logging.INFO


class EventLog:
    def __init__(self, capacity: int = 2000) -> None:
        self._events: deque[LogEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq = 0

    def emit(self, kind: EventKind, message: str, agent_id: str | None = None, level: int = logging.INFO) -> None:
        with self._lock:
            self._seq += 1
            event = LogEvent(self._seq, time.time(), kind, message, agent_id, level)
            self._events.append(event)
        log.log(level, message, extra={"event": kind.value, "agent_id": agent_id})

    def since(self, seq: int) -> list[LogEvent]:
        with self._lock:
            return [e for e in self._events if e.seq > seq]

    @property
    def last_seq(self) -> int:
        return self._seq
