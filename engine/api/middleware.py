"""ASGI middleware: request body size limit and API-key authentication."""

from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import ANTHROPIC_TYPES, OPENAI_PATHS

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health/", "/api/hello", "/docs", "/openapi.json", "/redoc")
OPEN_EXACT = ("/",)


class _BodyTooLarge(StarletteHTTPException):
    """An HTTPException so FastAPI re-raises it from its body parsing, which
    turns any other exception into "400 There was an error parsing the body"."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large(max_bytes))


def _openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PATHS)


async def send_error(scope: Scope, send: Send, status: int, message: str, param: str | None = None) -> None:
    if _openai_path(scope.get("path", "")):
        body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                          "param": param, "code": None}}
        if status == 401:
            body["error"]["type"] = "authentication_error"
    else:
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``, by Content-Length or by counting as they arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int, per_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = self.per_path.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return await send_error(scope, send, 413, _too_large(max_bytes))
        seen = 0
        started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise _BodyTooLarge(max_bytes)
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await send_error(scope, send, 413, _too_large(max_bytes))


def _too_large(max_bytes: int) -> str:
    return f"request body is larger than the {max_bytes} byte limit (setting max_body_mb)"


class ApiKeyMiddleware:
    """When a key is configured, every request but health probes must carry it."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.api_key or path.startswith(OPEN_PATHS) or path in OPEN_EXACT:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        offered = headers.get("x-api-key") or _bearer(headers.get("authorization", ""))
        if offered is None or not hmac.compare_digest(offered.encode(), self.api_key.encode()):
            return await send_error(scope, send, 401, "invalid or missing API key (send x-api-key or Authorization: Bearer)")
        return await self.app(scope, receive, send)


def _bearer(value: str) -> str | None:
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
