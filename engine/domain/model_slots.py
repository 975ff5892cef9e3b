"""The models a server keeps resident, and which of them serves a request by the request's ``model`` field.

Pure data: what the settings say (``--model``, ``--extra-model``,
``--model-route``) becomes one ``ModelSlot`` per model and one ``ModelRoutes``;
the resident set (engine/resident_models.py) loads and unloads them.

A request always gets a model: exact names first (a slot's alias, the last
part of its source, the model id its weights carry), then the configured
patterns, then the built-in ones (Claude Code's haiku tier and its side
requests to the ``side`` model when one is set), then the default model.
Claude Code and Codex name models this server does not have
(``claude-opus-4-8``, ``gpt-5-codex``); they are never refused for it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import PurePath

from engine.errors import InvalidRequestError

DEFAULT_ROLE = "main"
SIDE_ROLE = "side"
# Claude Code's small, fast tier: its title, classifier and summary requests, and subagents set to haiku.
SIDE_PATTERNS = ("*haiku*",)


class ModelSlotError(InvalidRequestError):
    """A ``--extra-model`` or ``--model-route`` value that does not parse (the message names it)."""


@dataclass(frozen=True, slots=True)
class ModelSlot:
    """One model the server may keep resident, as configured."""

    alias: str
    source: str  # what load_model takes: a registry alias, a folder, a .gguf file, a hub id
    pinned: bool = False  # loaded at start, never unloaded to make room
    role: str = DEFAULT_ROLE  # "side": Claude Code's haiku tier and side requests go here
    idle_unload_s: float | None = None
    pool_mb: float | None = None  # its KV pool budget (None: the server's pool_budget_mb)
    is_default: bool = False

    def names(self) -> tuple[str, ...]:
        """What a request may call it by, besides the model id its weights carry."""
        tail = PurePath(self.source.rstrip("/")).name
        return tuple(dict.fromkeys(n for n in (self.alias, self.source, tail) if n))


def parse_model_slot(text: str) -> ModelSlot:
    """``ALIAS=SOURCE[,pinned][,side][,idle=SECONDS][,pool=MiB]``; ModelSlotError naming what is wrong."""
    head, _, rest = text.partition(",")
    alias, eq, source = head.partition("=")
    alias, source = alias.strip(), source.strip()
    if not eq or not alias or not source:
        raise ModelSlotError(f"--extra-model {text!r}: expected ALIAS=SOURCE[,pinned][,side][,idle=S][,pool=MiB]",
                             field="extra_models")
    options: dict[str, object] = {}
    for option in (o.strip() for o in rest.split(",") if o.strip()) if rest else ():
        key, has_value, value = option.partition("=")
        key = key.strip().lower()
        try:
            if key == "pinned" and not has_value:
                options["pinned"] = True
            elif key == SIDE_ROLE and not has_value:
                options["role"] = SIDE_ROLE
            elif key == "idle" and has_value:
                options["idle_unload_s"] = _positive(value)
            elif key == "pool" and has_value:
                options["pool_mb"] = _positive(value)
            else:
                raise ValueError("options are pinned, side, idle=SECONDS and pool=MiB")
        except ValueError as exc:
            raise ModelSlotError(f"--extra-model {text!r}: option {option!r}: {exc}", field="extra_models") from None
    return ModelSlot(alias, source, **options)  # type: ignore[arg-type]


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise ValueError("must be a positive number")
    return number


def model_slots(default_source: str, extra: tuple[str, ...]) -> tuple[ModelSlot, ...]:
    """The default model (always pinned: a server never lacks its model) and the extra ones, aliases unique."""
    default = ModelSlot(default_source, default_source, pinned=True, is_default=True)
    slots = [default, *(parse_model_slot(text) for text in extra)]
    seen: set[str] = set()
    for slot in slots:
        key = slot.alias.casefold()
        if key in seen:
            raise ModelSlotError(f"--extra-model: the alias {slot.alias!r} is used twice", field="extra_models")
        seen.add(key)
    if sum(slot.role == SIDE_ROLE for slot in slots) > 1:
        raise ModelSlotError("--extra-model: only one model may be the side model", field="extra_models")
    return tuple(slots)


@dataclass(frozen=True, slots=True)
class ModelRoutes:
    """Request model names to slot aliases."""

    slots: tuple[ModelSlot, ...]
    patterns: tuple[tuple[str, str], ...] = ()  # (pattern, alias), configured ones first
    # Model ids the loaded weights carry, per alias (known once a model has loaded).
    model_ids: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, slots: tuple[ModelSlot, ...], routes: tuple[str, ...]) -> "ModelRoutes":
        aliases = {slot.alias.casefold(): slot.alias for slot in slots}
        patterns: list[tuple[str, str]] = []
        for text in routes:
            pattern, eq, alias = text.rpartition("=")
            if not eq or not pattern.strip() or alias.strip().casefold() not in aliases:
                known = ", ".join(aliases.values())
                raise ModelSlotError(f"--model-route {text!r}: expected PATTERN=ALIAS with ALIAS one of {known}",
                                     field="model_routes")
            patterns.append((pattern.strip().casefold(), aliases[alias.strip().casefold()]))
        side = next((slot.alias for slot in slots if slot.role == SIDE_ROLE), None)
        if side is not None:
            patterns += [(pattern, side) for pattern in SIDE_PATTERNS]
        return cls(slots, tuple(patterns))

    @property
    def default(self) -> ModelSlot:
        return next(slot for slot in self.slots if slot.is_default)

    @property
    def side(self) -> ModelSlot | None:
        return next((slot for slot in self.slots if slot.role == SIDE_ROLE), None)

    def slot(self, alias: str) -> ModelSlot:
        return next(slot for slot in self.slots if slot.alias == alias)

    def route(self, name: str | None, auxiliary: bool = False) -> tuple[ModelSlot, str]:
        """The slot that serves a request naming ``name``, and why (for usage and the log)."""
        wanted = (name or "").strip().casefold()
        if wanted:
            for slot in self.slots:
                names = {n.casefold() for n in slot.names()}
                model_id = self.model_ids.get(slot.alias)
                if wanted in names or (model_id is not None and wanted == model_id.casefold()):
                    return slot, "name"
            for pattern, alias in self.patterns:
                if fnmatch.fnmatchcase(wanted, pattern):
                    return self.slot(alias), f"pattern {pattern}"
        side = self.side
        if auxiliary and side is not None:
            return side, "side request"
        return self.default, "default"
