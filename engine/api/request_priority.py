"""The priority a request asks for: a body field where its protocol has one, else a header any client can set.

OpenAI bodies take ``priority`` (as vLLM accepts it); Anthropic clients put it in ``metadata.priority`` or
send ``x-semantic-priority`` (``semantic launch --priority`` sets the header on every request). A level is
0-9, 0 the most urgent, or a class name for its default (domain/priority.py). A bad value is a 400 naming
the field it came from.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine.domain.priority import parse_level
from engine.errors import InvalidRequestError

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
