"""Metadata of cold agents (cache dropped), kept so the UI can still list them."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.store.atomic_text import write_text_atomically

log = logging.getLogger("semantic.store")

MAX_COLD_ENTRIES = 500


@dataclass(frozen=True, slots=True)
class ColdEntry:
    agent_id: str
    n_tokens: int
    last_used: float
    display_name: str | None = None
    source: str | None = None


class ColdIndex:
    """Engine thread mutates; the I/O thread saves a copy taken under the lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, ColdEntry] = {}
        self._lock = threading.Lock()

    def load(self) -> list[ColdEntry]:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            entries = [ColdEntry(**item) for item in raw.get("agents", [])]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ignoring unreadable cold index %s: %s", self.path, exc)
            return []
        with self._lock:
            self._entries = {e.agent_id: e for e in entries}
        return entries

    def add(self, entry: ColdEntry) -> None:
        with self._lock:
            self._entries[entry.agent_id] = entry
            if len(self._entries) > MAX_COLD_ENTRIES:
                oldest = min(self._entries.values(), key=lambda e: e.last_used)
                del self._entries[oldest.agent_id]

    def remove(self, agent_id: str) -> bool:
        with self._lock:
            return self._entries.pop(agent_id, None) is not None

    def entries(self) -> list[ColdEntry]:
        with self._lock:
            return list(self._entries.values())

    def save(self) -> None:
        """Atomic write: temp file in the same directory, fsync, rename."""
        payload = json.dumps({"agents": [asdict(e) for e in self.entries()]}, indent=1)
        try:
            write_text_atomically(self.path, payload)
        except OSError as exc:
            log.warning("could not save cold index %s: %s", self.path, exc)
