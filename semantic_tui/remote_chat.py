"""The attached workbench's chats: turns through the server's direct agent API, shown as engine events.

A chat started in an attached workbench is a direct-API agent of the server
(``POST /v1/agents``), whose conversation the server keeps: any workbench
attached later, or any other client of that API, continues the same one. A
turn is ``POST /v1/agents/{id}/messages`` with ``stream: true``; its
``token``, ``reasoning``, ``done`` and ``error`` events become the TokenEvent
and FinishEvent the pane draws, so the pane is the embedded one's code.
Stopping a turn closes its connection, which cancels it on the server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any, Callable

import httpx

from engine.domain.chat import ChatMessage
from engine.domain.requests import AgentSource, EventSink, FinishEvent, FinishReason, TokenEvent, Usage
from engine.errors import SemanticError

from .chat_events import EventFeed
from .image_attachments import message_body
from .chat_link import ChatTarget, ChatTurn
from .sse_client import error_message, sse_frames

# How many ids a new chat tries when the one it wanted is taken (chat-3, chat-3-2, ...).
ID_ATTEMPTS = 20
_turns = itertools.count(1)


def finish_of(request_id: str, frame: str, data: dict[str, Any]) -> FinishEvent:
    """The finish a ``done`` (the turn's result) or ``error`` event says."""
    if frame == "error":
        error = data.get("error") if isinstance(data.get("error"), dict) else {}
        return FinishEvent(request_id, FinishReason.ERROR, Usage(0, 0, 0, 0),
                           error=str(error.get("message") or "the server failed this turn"),
                           error_type=error.get("type"))
    usage = data.get("usage") or {}
    return FinishEvent(request_id, FinishReason(data.get("finish_reason", "stop")), Usage(
        prompt_tokens=int(usage.get("prompt_tokens", 0)), reused_tokens=int(usage.get("reused_tokens", 0)),
        prefilled_tokens=int(usage.get("prefilled_tokens", 0)),
        generated_tokens=int(usage.get("generated_tokens", 0)),
        reasoning_tokens=int(usage.get("reasoning_tokens", 0)), ttft_s=usage.get("ttft_s"),
        decode_tok_s=usage.get("decode_tok_s")))


class RemoteTurn:
    """One turn's streaming response, read into a pane's feed."""

    def __init__(self, response: httpx.Response, request_id: str) -> None:
        self.response = response
        self.request_id = request_id
        self._task: asyncio.Task | None = None
        self._cancelled = False

    async def run(self, feed: EventFeed) -> None:
        self._task = asyncio.current_task()
        rid = self.request_id
        try:
            if self._cancelled:
                raise asyncio.CancelledError
            async for frame in sse_frames(self.response.aiter_lines()):
                data = json.loads(frame.data)
                if frame.event == "token":
                    feed.put(TokenEvent(rid, -1, str(data.get("text", ""))))
                elif frame.event == "reasoning":
                    feed.put(TokenEvent(rid, -1, "", reasoning=str(data.get("text", ""))))
                elif frame.event in ("done", "error"):
                    feed.put(finish_of(rid, frame.event, data))
                    return
            feed.put(FinishEvent(rid, FinishReason.ERROR, Usage(0, 0, 0, 0),
                                 error="the server ended the reply without finishing it"))
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
            feed.put(FinishEvent(rid, FinishReason.CANCELLED, Usage(0, 0, 0, 0)))
        except (httpx.HTTPError, ValueError) as exc:
            feed.put(FinishEvent(rid, FinishReason.ERROR, Usage(0, 0, 0, 0),
                                 error=f"the reply's stream broke ({type(exc).__name__}: {exc})"))
        finally:
            await self.response.aclose()

    def cancel(self) -> None:
        """Closing the connection is what stops the turn on the server."""
        if self._cancelled:
            return
        self._cancelled = True
        if self._task is not None and not self._task.done():
            self._task.cancel()


class RemoteChatLink:
    """Chats with a running server's direct-API agents."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    def drives(self, source: str) -> bool:
        # A direct-API agent's conversation lives on the server: a turn from here continues it. Any other
        # client's agent is that client's conversation.
        return source == AgentSource.API.value

    async def create(self, agent_id: str, label: str) -> str:
        for attempt in range(1, ID_ATTEMPTS + 1):
            wanted = agent_id if attempt == 1 else f"{agent_id}-{attempt}"
            response = await self._request("POST", "/v1/agents", json={"agent_id": wanted, "display_name": label})
            if response.status_code == 201:
                return str(response.json()["agent_id"])
            if response.status_code != 409:
                raise SemanticError(f"creating {wanted}: {error_message(response)}")
        raise SemanticError(f"no free agent id after {ID_ATTEMPTS} tries from {agent_id!r}")

    async def start(self, target: ChatTarget, history: tuple[ChatMessage, ...], user: ChatMessage) -> ChatTurn:
        """The server keeps the history; only the new message goes."""
        content, images = message_body(user)
        body: dict[str, Any] = {"content": content, "stream": True, "agent_class": "interactive",
                                **({"images": images} if images else {})}
        if target.max_tokens is not None:
            body["max_tokens"] = target.max_tokens
        if target.model is not None:
            body["model"] = target.model
        request = self._http.build_request("POST", f"/v1/agents/{target.agent_id}/messages", json=body)
        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise SemanticError(f"cannot reach the server ({type(exc).__name__})") from exc
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            raise SemanticError(error_message(response))
        return RemoteTurn(response, f"{target.agent_id}-turn-{next(_turns)}")

    def watch(self, agent_id: str, model: str | None, sink: EventSink) -> Callable[[], None] | None:
        return None  # another client's tokens stay on the server; its turns show in the log

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise SemanticError(f"cannot reach the server ({type(exc).__name__})") from exc
