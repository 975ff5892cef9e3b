"""Who an agent is to the person at the machine, and how urgent its turns are (docs/scheduling.md).

An agent has a class, read from what its client already sends (api/identity.py): a chat typed into the
workbench is a person at the keyboard (interactive); Claude Code's or Codex's session is the conversation a
person waits on (main); its subagents work in the background of it (subagent); its titles and classifiers are
side requests (side); a script with no person behind it can say so (background).

A turn's level is a number, 0 the most urgent, 9 the least: the operator's setting for the agent if there is
one, else what the request asked (a ``priority`` field or header), else its class's default. Turns are served
by *virtual arrival*: the moment they arrived plus ``level x aging_s``. A turn of level 3 is served as if it
had arrived 2 x aging_s after a level-1 turn that arrived with it. Because the order is fixed once a turn
arrives, nothing starves: a turn is overtaken only by turns that arrive within ``(its level - 0) x aging_s``
after it, so its wait is bounded by the work of the turns that arrived before it plus that window's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping

MOST_URGENT, LEAST_URGENT = 0, 9


class AgentClass(str, enum.Enum):
    INTERACTIVE = "interactive"  # a person typing in the workbench
    MAIN = "main"  # the conversation a person waits on (Claude Code's or Codex's session, an API agent)
    SIDE = "side"  # a client's side request: a title, a classifier, a probe
    SUBAGENT = "subagent"  # work a main agent handed off (Claude Code's Task tool, a Codex sub-thread)
    BACKGROUND = "background"  # nobody waits on it (batch scripts)


DEFAULT_LEVELS: Mapping[AgentClass, int] = {
    AgentClass.INTERACTIVE: 0, AgentClass.MAIN: 1, AgentClass.SIDE: 2, AgentClass.SUBAGENT: 3,
    AgentClass.BACKGROUND: 6,
}


def parse_level(value: object, field_name: str) -> int:
    """A priority level as a client or the operator writes it (an int 0-9, or a class name for its default);
    ValueError naming ``field_name`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name} must be an integer {MOST_URGENT}-{LEAST_URGENT} or a class name")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in {c.value for c in AgentClass}:
            return DEFAULT_LEVELS[AgentClass(text)]
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{field_name} must be an integer {MOST_URGENT}-{LEAST_URGENT} or one of "
                             f"{', '.join(c.value for c in AgentClass)}; got {value!r}") from None
    if not isinstance(value, int) or not MOST_URGENT <= value <= LEAST_URGENT:
        raise ValueError(f"{field_name} must be an integer {MOST_URGENT}-{LEAST_URGENT} "
                         f"(0 the most urgent); got {value!r}")
    return value


def parse_class(value: str, field_name: str) -> AgentClass:
    try:
        return AgentClass(value.strip().lower())
    except ValueError:
        raise ValueError(f"{field_name} must be one of {', '.join(c.value for c in AgentClass)}; "
                         f"got {value!r}") from None


def class_levels_from(pairs: tuple[str, ...]) -> dict[AgentClass, int]:
    """The per-class defaults with the settings' ``CLASS=LEVEL`` overrides applied."""
    levels = dict(DEFAULT_LEVELS)
    for pair in pairs:
        name, sep, level = pair.partition("=")
        if not sep:
            raise ValueError(f"class_priorities: expected CLASS=LEVEL, got {pair!r}")
        levels[parse_class(name, "class_priorities")] = parse_level(level, f"class_priorities {name}")
    return levels


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where an agent sits in its client's tree: the session it belongs to and the agent that started it."""

    family: str | None = None  # the session (Claude Code's session id, Codex's root thread): its agents group
    parent: str | None = None  # the agent id of its main agent, for a subagent or side request; None: a root


@dataclass(frozen=True, slots=True)
class PriorityPolicy:
    levels: Mapping[AgentClass, int] = field(default_factory=lambda: dict(DEFAULT_LEVELS))
    # Seconds of head start one level is worth (see the module's docstring); the bound on how long a less
    # urgent turn can be overtaken.
    aging_s: float = 10.0
    # Whether levels order anything: off, every turn is served first come, first served.
    enabled: bool = True

    def level(self, agent_class: AgentClass, asked: int | None = None, operator: int | None = None) -> int:
        """The operator's setting first, then the request's, then the class's default."""
        if operator is not None:
            return operator
        if asked is not None:
            return asked
        return self.levels.get(agent_class, DEFAULT_LEVELS[agent_class])

    def virtual_arrival(self, arrived_at: float, level: int) -> float:
        """The order key: earlier is served first."""
        if not self.enabled:
            return arrived_at
        return arrived_at + level * self.aging_s

    def overtaken_for_at_most(self, level: int) -> float:
        """Seconds after a turn's arrival within which a more urgent turn can still go ahead of it."""
        return (level - MOST_URGENT) * self.aging_s if self.enabled else 0.0
