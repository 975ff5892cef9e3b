"""Command-line flags generated from the Settings model, so every setting has a flag.

Flags default to "absent" (argparse.SUPPRESS): an unset flag never overrides
the environment or the TOML file.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import SecretStr

from engine.settings import Settings

# Flags that read better with a short alias.
ALIASES = {"model": ["-m"], "port": ["-p"]}


def settings_parser(without: frozenset[str] = frozenset()) -> argparse.ArgumentParser:
    """A parent parser holding one flag per setting, but those named in ``without``.

    ``without`` frees a flag for a command's own meaning; parsers share their
    parents' actions, so overriding one in place would change it everywhere.
    """
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group(
        "settings (flag > SEMANTIC_* env > .env > TOML > default; each in detail: docs/configuration.md)")
    for name, field in Settings.model_fields.items():
        if name in without:
            continue
        _add_flag(group, name, field.annotation, field.description or "", _default_text(field))
    return parser


def _add_flag(group: Any, name: str, annotation: Any, description: str, default: str) -> None:
    flag = "--" + name.replace("_", "-")
    env = f"SEMANTIC_{name.upper()}"
    help_text = f"{description} [env {env}; default {default}]"
    base = _unwrap_optional(annotation)
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
    if base is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        return
    if typing.get_origin(base) is tuple:  # a list setting: the flag is repeated, one value each time
        kwargs.update(action="append", metavar="TEXT")
        group.add_argument(flag, flag.removesuffix("s"), **kwargs)  # --extra-models or --extra-model
        return
    if typing.get_origin(base) is Literal:
        kwargs["choices"] = list(typing.get_args(base))
    else:
        kwargs["type"] = _converter(base)
        kwargs["metavar"] = _metavar(base)
    group.add_argument(flag, *ALIASES.get(name, []), **kwargs)


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _converter(base: Any) -> Any:
    if base in (int, float):
        return base
    if base is Path:
        return Path
    if base is SecretStr:
        return str
    return str


def _metavar(base: Any) -> str:
    return {int: "N", float: "X", Path: "PATH"}.get(base, "TEXT")


def _default_text(field: Any) -> str:
    if field.default_factory is not None:
        return "per platform"
    if isinstance(field.default, SecretStr) or field.default is None:
        return "unset"
    return str(field.default)


def overrides_from(namespace: argparse.Namespace) -> dict[str, Any]:
    """The settings the user actually passed on the command line."""
    return {name: value for name, value in vars(namespace).items() if name in Settings.model_fields}
