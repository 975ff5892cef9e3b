"""An ASGI middleware that records every request and its response, for evidence.

Added as the outermost middleware of the app under test, it sees exactly
what a client sent (path, query, headers, body) and what the server
answered (status, the whole body, SSE included), without changing either.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from tests.model.sse_grammar import check_anthropic_stream

Message = dict[str, Any]
ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]

# The headers worth showing in a report; credentials are shown only as present.
SHOWN_HEADERS = ("user-agent", "anthropic-version", "anthropic-beta", "x-claude-code-session-id",
                 "x-claude-code-agent-id", "x-app", "content-type", "originator")


@dataclass
class Exchange:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes = b""
    status: int | None = None
    response: bytearray = field(default_factory=bytearray)
    started: float = field(default_factory=time.monotonic)
    # Seconds from the request to the first generated content (a stream's first content_block_delta,
    # or the whole JSON body): the client's time to first token, pings and message_start aside.
    first_output_s: float | None = None

    def json(self) -> dict[str, Any]:
        return json.loads(self.body) if self.body else {}

    @property
    def session(self) -> str | None:
        return self.headers.get("x-claude-code-session-id")

    def usage(self) -> dict[str, Any] | None:
        """The Messages usage the client was told: the final one of a stream, or the JSON body's
        (for the Responses API, the usage of its closing response.completed/incomplete event)."""
        if self.status == 200 and self.path == "/v1/responses":
            return (self.final_response() or {}).get("usage")
        if self.status != 200 or not self.path.startswith("/v1/messages") or self.path.endswith("count_tokens"):
            return None
        text = self.response.decode()
        if text.startswith("{"):
            return json.loads(text)["usage"]
        stream = check_anthropic_stream(text)
        return {**stream.start_usage, **stream.final_usage}

    def final_response(self) -> dict[str, Any] | None:
        """A Responses API turn's response object as it ended (completed, incomplete or failed)."""
        text = self.response.decode(errors="replace")
        if text.startswith("{"):
            return json.loads(text)
        for line in reversed(text.splitlines()):
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("type") in ("response.completed", "response.incomplete", "response.failed"):
                    return event["response"]
        return None

    def summary(self) -> str:
        body = self.json() if self.body.startswith(b"{") else {}
        shape = {key: body[key] for key in ("model", "max_tokens", "stream") if key in body}
        if body:
            shape |= {"tools": [t.get("name") for t in body.get("tools", [])],
                      "system_blocks": _count(body.get("system")), "messages": len(body.get("messages", []))}
        shown = {k: v for k, v in self.headers.items() if k in SHOWN_HEADERS}
        shown |= {k: "<set>" for k in ("x-api-key", "authorization") if k in self.headers}
        return (f"{self.method} {self.path}{'?' + self.query if self.query else ''} -> {self.status}, "
                f"request {len(self.body)} B, response {len(self.response)} B\n  body {shape}\n  headers {shown}"
                f"\n  usage {self._usage_line()}{self._reply_summary()}")

    def _usage_line(self) -> str:
        try:
            return str(self.usage())
        except AssertionError as exc:  # a stream cut short (the client gave up): the report says so and goes on
            return f"none: {str(exc).splitlines()[0]}"

    def reply_text(self) -> str:
        """The text a Messages stream carried so far (a stream cut short included)."""
        text = []
        for line in self.response.decode(errors="replace").splitlines():
            if not line.startswith("data: {"):
                continue
            try:
                event = json.loads(line[6:])
            except ValueError:
                continue
            if event.get("type") == "response.output_text.delta":  # the Responses API
                text.append(event["delta"])
                continue
            delta = event.get("delta", {}) if event.get("type") == "content_block_delta" else {}
            text.append(delta.get("text", ""))
        return "".join(text)

    def _reply_summary(self) -> str:
        text = self.reply_text()
        if not text:
            return ""
        shown = repr(text) if len(text) <= 400 else f"{text[:200]!r} ... {text[-200:]!r}"
        return f"\n  reply {len(text)} chars: {shown}"


def _count(system: Any) -> int:
    return len(system) if isinstance(system, list) else int(bool(system))


class RequestLog:
    """ASGI middleware; ``exchanges`` fills in from the server's thread."""

    def __init__(self, app: ASGIApp, exchanges: list[Exchange]) -> None:
        self.app = app
        self.exchanges = exchanges
        self._lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        exchange = Exchange(scope["method"], scope["path"], scope.get("query_string", b"").decode(), headers)
        with self._lock:
            self.exchanges.append(exchange)

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                exchange.body += message.get("body", b"")
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                exchange.response += chunk
                if exchange.first_output_s is None and (b"content_block_delta" in chunk or chunk.startswith(b"{")):
                    exchange.first_output_s = time.monotonic() - exchange.started
            await send(message)

        await self.app(scope, recording_receive, recording_send)
