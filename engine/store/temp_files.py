"""Temporary files, named after the process writing them, and the start-up sweep of dead writers' ones.

Every file is written whole under a temporary name and renamed over its final
name, so a crash leaves the old file or the new one. What a crash does leave
is the temporary file. Each one is named ``.{stem}.{pid}.{random}{suffix}``:
the next start removes those whose writer is gone (its pid is not running,
or is the starting process's own: in a container the server has the same
pid every start), and those untouched for an hour whatever their pid (a pid
reused since). A live writer's file (another server or rank on the same
directory) is left alone, and so are this process's own after its first
sweep (a model reloaded in the same process sweeps again while its API may
be writing).
"""

from __future__ import annotations

import logging
import os
import re
import time
from contextlib import suppress
from pathlib import Path

log = logging.getLogger("semantic.store")

TEMP_NAME = re.compile(r"\.(?P<stem>.+)\.(?P<pid>[1-9][0-9]{0,9})\.(?P<tag>[A-Za-z0-9_]+)(?:\.tmp|\.safetensors)")
# A temp file untouched this long is a dead writer's even if its pid is running again.
STALE_S = 3600.0
# Folders of the cache directory the sweep leaves alone: imported models (the importer sweeps its own).
SKIPPED = ("models",)
_swept: set[Path] = set()  # roots this process swept already (its own temp files are live from then on)


def temp_prefix(stem: str) -> str:
    """The start of a temporary file's name for ``stem`` (``tempfile.mkstemp(prefix=...)`` adds the rest)."""
    return f".{stem}.{os.getpid()}."


def sweep_dead_temps(root: Path) -> list[Path]:
    """Remove dead writers' temporary files under ``root``; what was removed. Never raises (logs instead)."""
    removed: list[Path] = []
    now = time.time()
    me = os.getpid() if root not in _swept else None
    _swept.add(root)
    for folder, dirs, files in os.walk(root):
        if Path(folder) == root:
            dirs[:] = [d for d in dirs if d not in SKIPPED]
        for name in files:
            match = TEMP_NAME.fullmatch(name)
            if match is None:
                continue
            path = Path(folder) / name
            pid = int(match["pid"])
            with suppress(OSError):
                if pid == me or not pid_alive(pid) or now - path.stat().st_mtime > STALE_S:
                    path.unlink()
                    removed.append(path)
    if removed:
        log.info("removed %d temporary file(s) left by writers that died: %s", len(removed),
                 ", ".join(str(p.relative_to(root)) for p in removed[:5]))
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    except (OSError, OverflowError):
        return False
    return True
