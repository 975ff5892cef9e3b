"""The workbench's UI preferences (theme, key bindings, chat layout), kept in one JSON file.

Preferences are a convenience: a missing, unreadable or half-valid file never
stops the workbench. Whatever cannot be used falls back to its default and is
reported once through ``on_warning`` (a log line by default, since a TUI owns
the terminal and a printed warning would corrupt the screen).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import platformdirs

from themes import DEFAULT_THEME

log = logging.getLogger("semantic.tui.preferences")

FILE_NAME = "workbench.json"
Warn = Callable[[str], None]


class ChatLayout(str, enum.Enum):
    TABS = "tabs"  # one chat at a time, switched with tabs
    SPLIT = "split"  # chats side by side


@dataclass(slots=True)
class Preferences:
    """Mutable on purpose: the app changes a field (say the theme) and calls ``save()``."""

    theme: str = DEFAULT_THEME
    # Binding id -> key string, exactly what App.set_keymap takes.
    keymap: dict[str, str] = field(default_factory=dict)
    chat_layout: ChatLayout = ChatLayout.TABS
    # Where save() writes: the file it was loaded from; None means the default location.
    path: Path | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"theme": self.theme, "keymap": dict(self.keymap), "chat_layout": self.chat_layout.value}

    def save(self) -> Path:
        return save_preferences(self, self.path)


def default_preferences_path() -> Path:
    return Path(platformdirs.user_config_dir("semantic")) / FILE_NAME


def load_preferences(path: Path | None = None, on_warning: Warn | None = None) -> Preferences:
    """The saved preferences, or defaults for whatever is missing or invalid."""
    path = path or default_preferences_path()
    warn = on_warning or log.warning
    if not path.exists():
        return Preferences(path=path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        warn(f"ignoring unreadable preferences file {path} ({exc}); using defaults")
        return Preferences(path=path)
    if not isinstance(data, dict):
        warn(f"ignoring preferences file {path}: expected a JSON object; using defaults")
        return Preferences(path=path)
    return _from_json(data, path, warn)


def _from_json(data: dict[str, Any], path: Path, warn: Warn) -> Preferences:
    theme = data.get("theme", DEFAULT_THEME)
    if not isinstance(theme, str) or not theme:
        warn(f"{path}: 'theme' must be a theme name, got {theme!r}; using {DEFAULT_THEME!r}")
        theme = DEFAULT_THEME
    return Preferences(theme, _keymap(data.get("keymap", {}), path, warn), _layout(data, path, warn), path)


def _keymap(raw: object, path: Path, warn: Warn) -> dict[str, str]:
    if not isinstance(raw, dict):
        warn(f"{path}: 'keymap' must be an object of binding id to keys, got {raw!r}; ignoring it")
        return {}
    keymap = {k: v for k, v in raw.items() if isinstance(v, str) and v}
    dropped = sorted(set(raw) - set(keymap))
    if dropped:
        warn(f"{path}: ignoring keymap entries without a key string: {dropped}")
    return keymap


def _layout(data: dict[str, Any], path: Path, warn: Warn) -> ChatLayout:
    raw = data.get("chat_layout", ChatLayout.TABS.value)
    try:
        return ChatLayout(raw)
    except ValueError:
        choices = [layout.value for layout in ChatLayout]
        warn(f"{path}: 'chat_layout' must be one of {choices}, got {raw!r}; using 'tabs'")
        return ChatLayout.TABS


def save_preferences(preferences: Preferences, path: Path | None = None) -> Path:
    """Write atomically: a crash mid-write leaves the old file, never a truncated one."""
    path = path or default_preferences_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(preferences.to_json(), indent=2, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable; not every platform can open a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
