"""Checks on JSON request bodies that must run before FastAPI parses them.

* A body that is not UTF-8 (RFC 8259 allows nothing else; ``json.loads`` on
  bytes would also guess UTF-16/32).
* Nesting deeper than ``MAX_JSON_DEPTH``: ``json.loads`` raises RecursionError
  near the interpreter's limit, and a body just under it parses and then
  overflows the stack later, in rendering or hashing, as a 500.
* Strings holding lone surrogates (``"\\ud800"`` is valid JSON but not
  Unicode): tokenizers and UTF-8 files refuse them deep inside a turn.

Control characters inside strings are left alone: raw ones are already
malformed JSON, and escaped ones (ANSI colours, ``\\r``, NUL in tool output
that Claude Code forwards from a terminal) are legitimate text. Fields that
become identifiers validate their own characters (``identity``).

The common case costs two byte counts and one strict decode, all in C; only
a body with many brackets or a surrogate escape pays for a closer look.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from .middleware import ASGIApp, Receive, Scope, Send, send_error

MAX_JSON_DEPTH = 128
_CHECKED_METHODS = (b"POST", b"PUT", b"PATCH")
# One JSON string, escapes included (the unrolled form runs in linear time).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_CHUNK = 1 << 20
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadBody(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_json_body(body: bytes) -> None:
    """Raise BadBody for the defects above; malformed JSON is left to FastAPI's own message."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadBody(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH:
        raise BadBody(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(body):
        _check_surrogates(body)


def json_depth(body: bytes) -> int:
    """The deepest bracket nesting outside strings (of well-formed JSON; a bound otherwise)."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    depth = peak = 0
    # In chunks: a 32 MiB body of brackets would otherwise need 256 MiB of running sums.
    for at in range(0, len(brackets), _DEPTH_CHUNK):
        codes = np.frombuffer(brackets, dtype=np.uint8, count=min(_DEPTH_CHUNK, len(brackets) - at), offset=at)
        levels = depth + np.cumsum(np.where((codes == ord("[")) | (codes == ord("{")), 1, -1))
        peak, depth = max(peak, int(levels.max())), int(levels[-1])
    return peak


def _check_surrogates(body: bytes) -> None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return  # FastAPI reports malformed JSON with the position
    path = lone_surrogate_path(value)
    if path is not None:
        raise BadBody(f"{path or 'body'}: string holds a lone UTF-16 surrogate (not valid Unicode)", path or None)


def lone_surrogate_path(value: Any) -> str | None:
    """The dotted path (``messages.0.content``) of the first string or key that is not valid Unicode."""
    pending: list[tuple[Any, str]] = [(value, "")]
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return child_path
                pending.append((child, child_path))
        elif isinstance(item, list):
            pending.extend((child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item))
    return None


class JsonGuardMiddleware:
    """Reads a JSON request body, checks it, and hands it on unchanged; 400 in the protocol's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        checked = scope["type"] == "http" and scope.get("method", "").encode() in _CHECKED_METHODS
        if not checked or not _json_typed(scope):
            return await self.app(scope, receive, send)
        body, disconnected = await _read_body(receive)
        if not disconnected:
            try:
                check_json_body(body)
            except BadBody as bad:
                return await send_error(scope, send, 400, bad.message, param=bad.param)
        await self.app(scope, _replay(body, disconnected, receive), send)


def _json_typed(scope: Scope) -> bool:
    """JSON or no content type: the bodies FastAPI would parse as JSON."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, disconnected: bool, receive: Receive) -> Receive:
    """The body once, then the client's own messages (so disconnects are still seen)."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        if disconnected:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
