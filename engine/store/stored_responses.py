"""Stored responses of the OpenAI Responses API (``store: true``, the API's default).

A stored response can be read back (``GET /v1/responses/{id}``), listed
(``/input_items``), deleted, and continued with ``previous_response_id``:
the record keeps the agent that served it and the whole item history a
continuation starts from (earlier turns' items, this turn's input, its
output), so the next turn renders the same tokens and reuses the agent's
cache. Instructions are not part of the history: the API does not carry
them over.

One JSON file per response under ``<cache_dir>/responses``, written
atomically (temp file, fsync, ``os.replace``), so stored responses survive
a restart with their agent's cache. Ids are server-made (``resp_`` and 32
hex digits); any other id names no file and is simply not found. The oldest
files beyond ``keep`` are deleted as new ones are written, so the folder
cannot grow without bound. Every method does file work: callers run them
on worker threads, never on the event loop.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import CachePersistenceError
from engine.store.atomic_text import write_text_atomically

log = logging.getLogger("semantic.api")

FORMAT_VERSION = 1
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    agent_id: str
    created_at: float
    # The response object as the API returned it.
    response: dict[str, Any]
    # This request's input items, normalized (responses_items.input_items).
    input_items: list[dict[str, Any]]
    # What a continuation starts from: the chain's earlier items, this input, this output.
    history: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "id": self.id, "agent_id": self.agent_id, "created_at": self.created_at,
                "response": self.response, "input_items": self.input_items, "history": self.history}

    @classmethod
    def from_json(cls, data: Any) -> "StoredResponse":
        """Raises ValueError for anything but a well-formed version-1 record."""
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ValueError("not a version 1 stored response")
        fields = {"id": str, "agent_id": str, "created_at": (int, float), "response": dict,
                  "input_items": list, "history": list}
        for name, kind in fields.items():
            if not isinstance(data.get(name), kind):
                raise ValueError(f"{name} has the wrong type")
        if not all(isinstance(item, dict) and isinstance(item.get("type"), str)
                   for item in (*data["input_items"], *data["history"])):
            raise ValueError("an item is not an object with a type")
        return cls(data["id"], data["agent_id"], float(data["created_at"]), data["response"],
                   data["input_items"], data["history"])


class ResponseStore:
    """Stored responses on disk; a lock keeps one writer at a time (pruning lists the folder)."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = directory
        self.keep = keep
        self._lock = threading.Lock()

    def get(self, response_id: str) -> StoredResponse | None:
        if not RESPONSE_ID.match(response_id):
            return None
        path = self._path(response_id)
        try:
            found = StoredResponse.from_json(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log.warning("ignoring unreadable stored response %s: %s", path, exc)
            return None
        return found if found.id == response_id else None

    def put(self, record: StoredResponse) -> None:
        if not RESPONSE_ID.match(record.id):
            raise ValueError(f"not a response id: {record.id!r}")
        # ASCII escapes keep lone surrogates (valid in JSON input) readable back as UTF-8.
        payload = json.dumps(record.to_json(), ensure_ascii=True, separators=(",", ":"))
        final = self._path(record.id)
        with self._lock:
            try:
                write_text_atomically(final, payload)
            except OSError as exc:
                raise CachePersistenceError(f"cannot store response {record.id}: {exc}") from exc
            self._prune()

    def delete(self, response_id: str) -> bool:
        if not RESPONSE_ID.match(response_id):
            return False
        with self._lock:
            try:
                self._path(response_id).unlink()
            except FileNotFoundError:
                return False
            return True

    def count(self) -> int:
        with suppress(FileNotFoundError):
            return sum(1 for _ in self.directory.glob("resp_*.json"))
        return 0

    def _prune(self) -> None:
        """Delete the oldest stored responses beyond ``keep`` (by modification time)."""
        files = list(self.directory.glob("resp_*.json"))
        if len(files) <= self.keep:
            return
        def mtime(path: Path) -> float:
            try:
                return path.stat().st_mtime
            except OSError:
                return 0.0
        for path in sorted(files, key=mtime)[:len(files) - self.keep]:
            with suppress(OSError):
                path.unlink()

    def _path(self, response_id: str) -> Path:
        return self.directory / f"{response_id}.json"
