"""Making a rename survive a power cut: fsync the file before it is renamed, and its directory after.

A rename is atomic against a crash of the process, but until the directory's
entry is on disk a power cut can bring back the old name (or none); the
data itself needs the file's own fsync first. On macOS ``fsync`` stops at the
drive's cache, and ``F_FULLFSYNC`` asks the drive to persist.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import suppress
from pathlib import Path


def sync_file(fd: int) -> None:
    """The file's data and metadata on stable storage (F_FULLFSYNC where the platform has it)."""
    full_sync = getattr(fcntl, "F_FULLFSYNC", None)
    if full_sync is not None:
        with suppress(OSError):  # file systems without it fall back to fsync
            fcntl.fcntl(fd, full_sync)
            return
    os.fsync(fd)


def sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable. Best effort: if it is lost, the old whole file remains."""
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
