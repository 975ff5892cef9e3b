"""Where this cache dir's server listens: ``listener.json``, so ``semantic attach`` finds it with no URL.

The server (headless or a workbench's embedded listener) writes the file once
it listens and removes it when it stops; a server that died leaves it behind,
so a reader trusts it only while the process it names is alive. Written
atomically: a reader sees the old address or the new one, never half.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from engine.store.atomic_text import write_text_atomically

log = logging.getLogger("semantic.api")

FILE_NAME = "listener.json"


def write_listener(cache_dir: Path, url: str) -> None:
    """Record ``url`` as this process's listener (a warning, never an error, when the disk refuses)."""
    body = {"url": url, "pid": os.getpid(), "started_at": time.time()}
    try:
        write_text_atomically(cache_dir / FILE_NAME, json.dumps(body) + "\n")
    except OSError as exc:
        log.warning("could not record the listening address in %s: %s", cache_dir / FILE_NAME, exc)


def remove_listener(cache_dir: Path) -> None:
    """Remove the record if it is this process's (another server may have written its own since)."""
    path = cache_dir / FILE_NAME
    if _read(path).get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def recorded_listener(cache_dir: Path) -> str | None:
    """The URL of the server recorded in ``cache_dir``, while its process lives; None otherwise."""
    body = _read(cache_dir / FILE_NAME)
    pid, url = body.get("pid"), body.get("url")
    if not isinstance(pid, int) or not isinstance(url, str) or not _alive(pid):
        return None
    return url


def _read(path: Path) -> dict:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
