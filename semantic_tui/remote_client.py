"""The workbench's client of a running server (``semantic attach``): one live stream in, the HTTP API out.

The picture comes from ``GET /v1/stream`` (stats snapshots at a steady rate,
engine events as they happen), read by one task on the app's event loop; the
controls are the same calls any client of the API makes. When the server goes
away (a restart, a crash, the network) the task keeps trying, resuming the event
log after the last event it saw, and the state says why it is not live. Closing
the client closes the connection, never the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from engine.domain.event_log import EventKind, LogEvent
from engine.models.registry import RegistryEntry
from engine.errors import SemanticError

from .remote_chat import RemoteChatLink
from .sse_client import SseFrame, error_message, sse_frames
from .stats_snapshot import snapshot_from_stats
from .remote_swap import RemoteSwap, registry_entry, swap_status
from .remote_transfer import AGENT_FILE_TYPE, download, file_chunks
from .workbench_client import AgentAction, Forked, ModelsView, SwapWatch, Transferred, WorkbenchState

log = logging.getLogger("semantic.tui")

STREAM_PATH = "/v1/stream"
RETRY_S = (0.5, 1.0, 2.0, 4.0)  # waits between reconnects; the last repeats
EVENTS_KEPT = 2000  # as many as the server's own event log keeps


class RemoteEvents:
    """The server's engine events as they arrived, with the server's own sequence numbers."""

    def __init__(self) -> None:
        self._events: deque[LogEvent] = deque(maxlen=EVENTS_KEPT)

    def add(self, event: LogEvent) -> None:
        if not self._events or event.seq > self._events[-1].seq:
            self._events.append(event)

    def since(self, seq: int) -> list[LogEvent]:
        return [event for event in self._events if event.seq > seq]

    @property
    def last_seq(self) -> int:
        return self._events[-1].seq if self._events else 0


class RemoteClient:
    embedded = False

    def __init__(self, address: str, api_key: str | None = None, interval_s: float = 0.5,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.address = address.rstrip("/")
        self.interval_s = interval_s
        headers = {"x-api-key": api_key} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.address, headers=headers, transport=transport,
                                       timeout=httpx.Timeout(30.0, read=None))
        self.events = RemoteEvents()
        self.chat = RemoteChatLink(self._http)
        self._state = WorkbenchState(None, link=f"connecting to {self.address}")
        self._task: asyncio.Task | None = None
        self.connections = 0  # streams opened so far: a reconnect makes it 2

    # -- the live picture ---------------------------------------------------------------------------
    def state(self) -> WorkbenchState:
        return self._state

    def start(self) -> None:
        """Start reading the stream (on the running event loop); idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow(), name="semantic-attach-stream")

    async def _follow(self) -> None:
        failures = 0
        while True:
            try:
                await self._read_stream()
                reason = "the server closed the stream"
            except httpx.HTTPError as exc:
                reason = f"cannot reach {self.address} ({type(exc).__name__})"
            except SemanticError as exc:
                reason = str(exc)
            failures = 0 if self._state.link is None else failures + 1  # a live stream that ended: retry soon
            wait = RETRY_S[min(failures, len(RETRY_S) - 1)]
            self._set_link(f"{reason}; retrying in {wait:g} s")
            await asyncio.sleep(wait)

    async def _read_stream(self) -> None:
        headers = {"last-event-id": str(self.events.last_seq)} if self.events.last_seq else {}
        params = {"interval": self.interval_s, "blocks": "true"}
        async with self._http.stream("GET", STREAM_PATH, params=params, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                raise SemanticError(self._refusal(response))
            self.connections += 1
            self._set_link(None)
            async for frame in sse_frames(response.aiter_lines()):
                self._apply(frame)

    def _refusal(self, response: httpx.Response) -> str:
        if response.status_code == 401:
            return f"{self.address} refused the API key: pass the server's key with --api-key"
        if response.status_code == 404:
            return f"{self.address} has no {STREAM_PATH}: is it a semantic server of this version?"
        return f"{self.address} refused the stream: {error_message(response)}"

    def _apply(self, frame: SseFrame) -> None:
        if frame.event == "stats":
            self._state = self._state_from(json.loads(frame.data))
        elif frame.event == "log":
            self.events.add(_event(json.loads(frame.data)))

    @staticmethod
    def _state_from(stats: dict[str, Any]) -> WorkbenchState:
        rows = tuple(stats.get("models") or ())
        models = None
        if rows and stats.get("models_budget") is not None:
            default = next((row["alias"] for row in rows if row.get("default")), rows[0]["alias"])
            models = ModelsView(rows, stats["models_budget"], default)
        return WorkbenchState(snapshot_from_stats(stats), models=models, stalled_s=stats.get("stalled_s"))

    def _set_link(self, why: str | None) -> None:
        state = self._state
        self._state = WorkbenchState(state.snapshot, state.extra, state.models, state.stalled_s, state.swap_phase, why)

    # -- controls -------------------------------------------------------------------------------------
    async def agent_action(self, model: str | None, agent_id: str, action: AgentAction) -> None:
        path = f"/v1/agents/{agent_id}"
        params = {"model": model} if model is not None else {}
        if action is AgentAction.DELETE:
            await self._call("DELETE", path, params=params)
        elif action in (AgentAction.PIN, AgentAction.UNPIN):
            await self._call("POST", f"{path}/pin", params=params, json={"pinned": action is AgentAction.PIN})
        else:
            tier = "warm" if action is AgentAction.EVICT else "cold"
            await self._call("POST", f"{path}/evict", params=params, json={"tier": tier})

    async def steer(self, model: str | None, agent_id: str, priority: int | None = None,
                    paused: bool | None = None) -> None:
        params = {"model": model} if model is not None else {}
        if priority is not None:
            await self._call("POST", f"/v1/agents/{agent_id}/priority", params=params, json={"priority": priority})
        if paused is not None:
            await self._call("POST", f"/v1/agents/{agent_id}/pause", params=params, json={"paused": paused})

    async def fork(self, model: str | None, agent_id: str, new_id: str, display_name: str) -> Forked:
        params = {"model": model} if model is not None else {}
        body = await self._call("POST", f"/v1/agents/{agent_id}/fork", params=params,
                                json={"name": new_id, "display_name": display_name})
        return Forked(body["agent"]["agent_id"], body["cached_tokens"], body["shared_tokens"], body["messages"] > 0)

    async def rewind(self, model: str | None, agent_id: str, turn: int) -> int:
        params = {"model": model} if model is not None else {}
        body = await self._call("POST", f"/v1/agents/{agent_id}/rewind", params=params, json={"turn": turn})
        return int(body["cached_tokens"])

    async def export_agent(self, model: str | None, agent_id: str, path: Path) -> Transferred:
        """GET /v1/agents/{id}/export, written to ``path`` as it arrives (atomically: a temp file beside it)."""
        params = {"model": model} if model is not None else {}
        request = self._http.build_request("GET", f"/v1/agents/{agent_id}/export", params=params)
        response = await self._send(request)
        try:
            nbytes = await download(response, path)
        finally:
            await response.aclose()
        return Transferred(agent_id, int(response.headers.get("x-semantic-tokens", 0)), nbytes, path, model)

    async def import_agent(self, path: Path) -> Transferred:
        """POST /v1/agents/import with the file as the body, read from the disk a chunk at a time."""
        request = self._http.build_request("POST", "/v1/agents/import", content=file_chunks(path),
                                           headers={"content-type": AGENT_FILE_TYPE})
        response = await self._send(request)
        body = await response.aread()
        await response.aclose()
        out = json.loads(body)
        model, models = out["agent"].get("model"), self._state.models  # an extra model's alias, or the default
        extra = model if models is not None and model != models.default else None
        return Transferred(out["agent"]["agent_id"], int(out["tokens"]), int(out["bytes"]), None, extra)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """A streamed request; SemanticError with the server's message when it refuses."""
        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise SemanticError(f"cannot reach {self.address} ({type(exc).__name__})") from exc
        if response.status_code >= 400:
            await response.aread()
            await response.aclose()
            raise SemanticError(error_message(response))
        return response

    async def swap_choices(self) -> list[RegistryEntry]:
        body = await self._call("GET", "/v1/models")
        return [registry_entry(model) for model in body["data"]]

    async def start_swap(self, entry: RegistryEntry) -> SwapWatch:
        """POST /v1/admin/swap, then GET its progress every few tenths of a second until it ends."""
        watch = RemoteSwap(swap_status(await self._call("POST", "/v1/admin/swap", json={"model": entry.location})))
        watch.follow(self._call)
        return watch

    async def evict_idle(self, to_disk: bool) -> int:
        body = await self._call("POST", "/v1/admin/evict-idle", json={"tier": "warm" if to_disk else "cold"})
        return int(body["evicted"])

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise SemanticError(f"cannot reach {self.address} ({type(exc).__name__})") from exc
        if response.status_code >= 400:
            raise SemanticError(error_message(response))
        return response.json()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self._http.aclose()


def _event(data: dict[str, Any]) -> LogEvent:
    try:
        kind = EventKind(data.get("kind", "info"))
    except ValueError:
        kind = EventKind.INFO  # a kind a newer server added: still shown
    return LogEvent(int(data["seq"]), float(data.get("at", 0.0)), kind, str(data.get("message", "")),
                    data.get("agent_id"), int(data.get("level", logging.INFO)))
