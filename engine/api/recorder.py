"""Recording what clients send (``--record-requests PATH``), for ``bench/replay.py``.

Every POST to a chat endpoint (Anthropic Messages, OpenAI chat completions, the Responses API) is appended to a JSONL file as one line:
``t`` (seconds since the recorder started), ``duration_s`` (until the
response's last byte), ``status``, ``method``, ``path``, ``headers`` (secrets
removed) and ``body`` (the JSON as sent). Replaying keeps each session's
order and the pauses between its requests.

Lines go to the file from a writer thread, so the event loop never waits on
the disk; each line is written whole and flushed, so a crash loses at most
the requests still in the queue, never a half line.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The chat protocols: what a client of another server would send too, so a trace replays anywhere
# (Responses API turns replay on a chat-completions-only server through bench/trace_format.py).
RECORDED_PATHS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
SECRET_HEADERS = frozenset({"x-api-key", "authorization", "cookie", "proxy-authorization"})
_STOP = object()


def recorded(path: str) -> bool:
    return path.rstrip("/") in RECORDED_PATHS


class TraceWriter:
    """Appends JSON lines to ``path`` from its own thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="semantic-recorder", daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        self._queue.put(record)

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is _STOP:
                break
            try:
                self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
                self._file.flush()
            except (OSError, TypeError, ValueError) as exc:  # a full disk must not stop the server
                log.warning("request recorder could not write %s: %s", self.path, exc)
        self._file.close()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)


class RecorderMiddleware:
    def __init__(self, app: ASGIApp, writer: TraceWriter) -> None:
        self.app = app
        self.writer = writer
        self.started = time.monotonic()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not recorded(scope.get("path", "")):
            return await self.app(scope, receive, send)
        began = time.monotonic()
        chunks: list[bytes] = []
        status = 0

        async def recording_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def recording_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            self.writer.write(self._record(scope, b"".join(chunks), began, status))

    def _record(self, scope: Scope, raw: bytes, began: float, status: int) -> dict[str, Any]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "") + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = {"unparsed": raw.decode("utf-8", "replace")}
        return {
            "t": round(began - self.started, 4), "duration_s": round(time.monotonic() - began, 4), "status": status,
            "method": "POST", "path": path,
            "headers": {k: v for k, v in headers.items() if k not in SECRET_HEADERS and k != "content-length"},
            "body": body,
        }
