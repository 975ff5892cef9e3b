"""What an agent id may be: it names files on disk and appears in URLs, so only a safe alphabet."""

from __future__ import annotations

import re

from engine.errors import InvalidRequestError

AGENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}$")


def validate_agent_id(value: str, field: str = "agent_id") -> str:
    """``value`` when it is a valid agent id; else the request's error, naming ``field``."""
    if not isinstance(value, str) or not AGENT_ID.match(value):
        raise InvalidRequestError(
            f"{field} must be 1-128 characters of letters, digits and . _ : @ + = - (starting with a letter or digit)",
            field=field,
        )
    return value
