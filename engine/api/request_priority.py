"""The priority a request asks for: a body field where its protocol has one, else a header any client can set.

OpenAI bodies take ``priority`` (as vLLM accepts it); Anthropic clients put it in ``metadata.priority`` or
send ``x-semantic-priority`` (``semantic launch --priority`` sets the header on every request). A level is
0-9, 0 the most urgent, or a class name for its default (domain/priority.py). A bad value is a 400 naming
the field it came from.

A server without ``--api-key`` cannot tell one client from another, so what a request says of itself is
limited there: ``--open-priority-limit`` (default 1) is the most urgent level a request can reach by its own
field, header or class hint, so no client outranks a main agent; the workbench's own chats and the operator's
settings (``POST /v1/agents/{id}/priority``) are not limited. With a key, every request has shown it.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine.domain.priority import AgentClass, class_levels_from, parse_level
from engine.errors import InvalidRequestError
from engine.settings import Settings

PRIORITY_HEADER = "x-semantic-priority"


def asked_priority(body_value: Any, body_field: str, headers: Mapping[str, str]) -> int | None:
    """The level the request asks for (the body's field first), or None when it asks none."""
    if body_value is not None:
        return _level(body_value, body_field)
    header = headers.get(PRIORITY_HEADER)
    if header is not None and header.strip():
        return _level(header, PRIORITY_HEADER)
    return None


def _level(value: Any, field: str) -> int:
    try:
        return parse_level(value, field)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), field=field) from None


def limited_priority(asked: int | None, agent_class: AgentClass, by_operator: bool, settings: Settings) -> int | None:
    """The level a turn may ask for: ``asked`` (or its class's default, for a class hint more urgent than the
    limit) held to ``--open-priority-limit`` on a server without an API key."""
    limit = settings.open_priority_limit
    if by_operator or settings.api_key is not None or limit == 0:
        return asked
    level = asked if asked is not None else class_levels_from(settings.class_priorities)[agent_class]
    return limit if level < limit else asked
