"""The warm-cache directory as a whole: indexing it at start-up and setting bad files aside.

A bad file is quarantined rather than deleted so that a corruption can still
be examined; temp files left by crashed writers are deleted, since they were
never a whole cache.
"""

from __future__ import annotations

import os
import secrets
import time
from contextlib import suppress
from pathlib import Path

from engine.errors import CacheCorruptionError, CachePersistenceError

from engine.store.cache_file.format import TEMP_NAME, QUARANTINE_DIR, STALE_TEMP_SECONDS, SUFFIX, ScanResult
from engine.store.cache_file.reader import read_header
from engine.store.cache_file.writer import remove_quietly
from engine.store.private_dirs import make_private_dir
from engine.store.temp_files import pid_alive


def scan_directory(directory: Path) -> ScanResult:
    """Headers of every cache file, for start-up indexing; bad files are listed, not touched.

    Also removes temp files that crashed writers left behind.
    """
    try:
        names = sorted(os.listdir(directory)) if directory.is_dir() else []
    except OSError as err:
        raise CachePersistenceError(f"cannot list warm cache directory {directory}: {err}") from err
    _remove_stale_temps(directory, names)
    result = ScanResult([], [])
    for name in names:
        if name.endswith(SUFFIX) and not name.startswith("."):
            try:
                result.headers.append((directory / name, read_header(directory / name)))
            except CacheCorruptionError as err:
                result.bad.append((directory / name, str(err)))
    return result


def _remove_stale_temps(directory: Path, names: list[str]) -> None:
    now = time.time()
    for name in names:
        match = TEMP_NAME.fullmatch(name)
        if match is None:
            continue
        path = directory / name
        with suppress(OSError):
            # A live writer keeps touching its file; one idle for a minute is dead
            # even if its pid has since been reused.
            if not pid_alive(int(match[1])) or now - path.stat().st_mtime > STALE_TEMP_SECONDS:
                path.unlink()


def quarantine(path: Path, reason: str) -> Path | None:
    """Move a bad cache file into ``quarantine/`` with a ``.reason.txt`` beside it.

    Deletes it when it cannot be moved; returns where it went, or None. Never raises.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.parent / QUARANTINE_DIR / f"{stamp}-{secrets.token_hex(3)}-{path.name}"
    try:
        make_private_dir(target.parent)
        os.replace(path, target)
    except OSError:
        remove_quietly(path)
        return None
    with suppress(OSError):
        reason_file = target.with_name(target.name + ".reason.txt")
        reason_file.write_text(reason + "\n", encoding="utf-8", errors="backslashreplace")
    return target
