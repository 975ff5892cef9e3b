"""Metadata of cold agents (cache dropped), kept so the UI can still list them."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.store.private_dirs import make_private_dir

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
        temp: str | None = None
        try:
            make_private_dir(self.path.parent)
            fd, temp = tempfile.mkstemp(prefix=".cold-", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, self.path)
        except OSError as exc:
            log.warning("could not save cold index %s: %s", self.path, exc)
            if temp is not None:
                with suppress(OSError):
                    os.unlink(temp)  # a full disk must not also collect half-written temp files
