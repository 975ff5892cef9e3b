"""A real size-limited file system for disk-full tests, where the machine lets the test mount one."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(directory: Path, size: str) -> Iterator[None]:
    """Mount a tmpfs of ``size`` (e.g. "2m") at a new ``directory``; skip the test where mounting is refused."""
    directory.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root, CAP_SYS_ADMIN): {mount.stderr.strip()}")
    try:
        yield
    finally:
        # Lazy: a file the test left open must not make the unmount fail the test.
        subprocess.run(["umount", "-l", str(directory)], check=True)
