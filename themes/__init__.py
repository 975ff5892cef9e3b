"""The workbench's colour themes: one TOML file per theme, loaded as Textual ``Theme`` objects.

A theme file holds the fields of ``textual.theme.Theme`` (colours as CSS colour
strings, ``dark`` as a boolean, an optional ``[variables]`` table). Files are
validated on load so a typo names the file and the key instead of surfacing
later as an unreadable Textual error or a silently ignored colour.
"""

from __future__ import annotations

import tomllib
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Protocol

from textual.color import Color, ColorParseError
from textual.theme import BUILTIN_THEMES, Theme

DEFAULT_THEME = "semantic-dark"
# Themes that keep the terminal's own palette (ANSI colours, default background). Textual
# 8 ships them as ansi-dark / ansi-light; older releases had one "textual-ansi".
TERMINAL_THEMES: tuple[str, ...] = tuple(
    name for name in ("textual-ansi", "ansi-dark", "ansi-light") if name in BUILTIN_THEMES
)
THEME_CHOICES: tuple[str, ...] = ("semantic-dark", "semantic-light", *TERMINAL_THEMES)
"""What the theme picker offers: ours, then the built-in ones that follow the terminal's colours."""

COLOR_KEYS = (
    "primary", "secondary", "accent", "foreground", "background",
    "surface", "panel", "boost", "success", "warning", "error",
)
FRACTION_KEYS = ("luminosity_spread", "text_alpha")
# dark is required: a light theme that forgets it would get dark-mode derived colours.
REQUIRED_KEYS = ("name", "primary", "dark")
ALLOWED_KEYS = frozenset((*COLOR_KEYS, *FRACTION_KEYS, "name", "dark", "variables"))


class ThemeFileError(ValueError):
    """A theme file that cannot become a Theme; names the file and the offending key."""

    def __init__(self, source: str, key: str | None, problem: str) -> None:
        where = f"{source}: key {key!r}" if key else source
        super().__init__(f"invalid theme file {where}: {problem}")
        self.source = source
        self.key = key


class _ThemeHost(Protocol):
    def register_theme(self, theme: Theme) -> None: ...


def load_themes(directory: Path | Traversable | None = None) -> list[Theme]:
    """Every ``*.toml`` theme in ``directory`` (default: the shipped themes), sorted by file name."""
    root = directory if directory is not None else files(__name__)
    paths = sorted((p for p in root.iterdir() if p.name.endswith(".toml")), key=lambda p: p.name)
    themes: dict[str, Theme] = {}
    for path in paths:
        theme = load_theme_file(path)
        if theme.name in themes:
            raise ThemeFileError(str(path), "name", f"theme {theme.name!r} is already defined by another file")
        themes[theme.name] = theme
    return list(themes.values())


def load_theme_file(path: Path | Traversable) -> Theme:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ThemeFileError(str(path), None, f"not valid TOML ({exc})") from exc
    return theme_from_mapping(data, str(path))


def theme_from_mapping(data: dict[str, Any], source: str) -> Theme:
    """Check every key of a parsed theme file, then build the Theme."""
    for key in sorted(data):
        if key not in ALLOWED_KEYS:
            raise ThemeFileError(source, key, f"unknown key; expected one of {sorted(ALLOWED_KEYS)}")
    for key in REQUIRED_KEYS:
        if key not in data:
            raise ThemeFileError(source, key, "missing")
    _check_name(data["name"], source)
    if not isinstance(data["dark"], bool):
        raise ThemeFileError(source, "dark", f"must be true or false, got {data['dark']!r}")
    for key in COLOR_KEYS:
        if key in data:
            _check_color(data[key], key, source)
    for key in FRACTION_KEYS:
        if key in data:
            _check_fraction(data[key], key, source)
    _check_variables(data.get("variables", {}), source)
    return Theme(**data)


def _check_name(name: object, source: str) -> None:
    if not isinstance(name, str) or not name.strip():
        raise ThemeFileError(source, "name", f"must be a non-empty string, got {name!r}")


def _check_color(value: object, key: str, source: str) -> None:
    if not isinstance(value, str):
        raise ThemeFileError(source, key, f"must be a colour string, got {value!r}")
    try:
        Color.parse(value)
    except ColorParseError as exc:
        raise ThemeFileError(source, key, f"{value!r} is not a colour") from exc


def _check_fraction(value: object, key: str, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ThemeFileError(source, key, f"must be a number from 0 to 1, got {value!r}")


def _check_variables(variables: object, source: str) -> None:
    if not isinstance(variables, dict):
        raise ThemeFileError(source, "variables", "must be a table of CSS variable names to strings")
    for name, value in variables.items():
        if not isinstance(value, str):
            raise ThemeFileError(source, f"variables.{name}", f"must be a string, got {value!r}")


def register_themes(app: _ThemeHost, directory: Path | Traversable | None = None) -> list[str]:
    """Register the shipped themes on ``app``; returns their names, in file order."""
    themes = load_themes(directory)
    for theme in themes:
        app.register_theme(theme)
    return [theme.name for theme in themes]
