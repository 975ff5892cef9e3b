"""Directories only their owner may enter (0700): agent caches, conversations, logs.

KV caches encode prompts and conversation files hold them verbatim, so every
folder semantic keeps them in is user-only, whoever's umask is in force.

Folders semantic creates are made 0700, missing parents included (the cache
root too, so a fresh install is private from the start). A private folder that
already exists with group or other access is tightened: its name says it is
semantic's own. The cache root itself is only *warned* about when it is open:
``--cache-dir`` may point at a directory the user shares on purpose (a models
folder, a project directory), and changing its mode would take access away
from others without asking. Imported models (``models/``) keep their mode.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("semantic.store")

PRIVATE_MODE = 0o700
_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) user-only; tighten it if it exists open to others.

    Raises OSError when it cannot be created; a mode it cannot change (another
    user's folder) is logged, not raised.
    """
    _create_missing(path)
    mode = path.stat().st_mode
    if mode & _OTHERS:
        try:
            os.chmod(path, PRIVATE_MODE)
        except OSError as exc:
            log.warning("cannot make %s private (mode %s): %s", path, oct(stat.S_IMODE(mode)), exc)
    return path


def prepare_cache_root(root: Path) -> None:
    """Create the cache root user-only; warn (once per start) when an existing one is open to others."""
    try:
        _create_missing(root)
        mode = stat.S_IMODE(root.stat().st_mode)
    except OSError as exc:
        log.warning("cannot create the cache directory %s: %s", root, exc)
        return
    if mode & _OTHERS:
        log.warning(
            "cache directory %s is open to other users (mode %s); semantic keeps agent caches, conversations and "
            "logs in private subfolders, but `chmod 700 %s` hides the rest too", root, oct(mode), root,
        )


def _create_missing(path: Path) -> None:
    missing = []
    at = path
    while not at.is_dir():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for folder in reversed(missing):
        try:
            # mkdir applies the mode minus the umask; 0700 survives every usual umask.
            os.mkdir(folder, PRIVATE_MODE)
        except FileExistsError:
            if not folder.is_dir():
                raise
