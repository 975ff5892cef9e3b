"""Writing a small text file so a crash leaves the old file or the new one, never half of either."""

from __future__ import annotations

import os
import tempfile
from contextlib import suppress
from pathlib import Path

from engine.store.durable import sync_directory, sync_file
from engine.store.private_dirs import make_private_dir
from engine.store.temp_files import temp_prefix


def write_text_atomically(final: Path, text: str) -> None:
    """A temp file beside ``final`` (private directory made if missing; named for the start-up sweep,
    temp_files.py), fsync, ``os.replace``, then fsync of the directory (durable.py: a power cut keeps the
    new name).

    Raises OSError; the temp file is removed first, so a full disk does not also collect half-written
    temp files. Callers turn the error into their own (a domain error, or a warning).
    """
    temp: str | None = None
    try:
        make_private_dir(final.parent)
        fd, temp = tempfile.mkstemp(prefix=temp_prefix(final.name), suffix=".tmp", dir=final.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            sync_file(handle.fileno())
        os.replace(temp, final)
        sync_directory(final.parent)
    except OSError:
        if temp is not None:
            with suppress(OSError):
                os.unlink(temp)
        raise
