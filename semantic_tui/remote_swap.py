"""A model swap of a server the workbench is attached to: its choices from GET /v1/models, its progress from
GET /v1/admin/swap, in the types the embedded workbench's picker and progress screen read."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from engine.errors import SemanticError
from engine.models.registry import RegistryEntry
from engine.swap import SwapPhase, SwapStatus

log = logging.getLogger("semantic.tui")

POLL_S = 0.25


def registry_entry(model: dict[str, Any]) -> RegistryEntry:
    """A /v1/models row as the model picker lists it; its id is what POST /v1/admin/swap takes."""
    return RegistryEntry(
        model_id=str(model["id"]), kind=str(model.get("kind") or "model"), location=str(model["id"]),
        aliases=tuple(model.get("aliases") or ()), present=bool(model.get("present")),
        size_bytes=model.get("size_bytes"), architecture=model.get("architecture"),
        cache_spec=model.get("cache_spec"), loaded=bool(model.get("loaded")),
        description=str(model.get("description") or ""))


def swap_status(progress: dict[str, Any]) -> SwapStatus:
    """The server's SwapProgress as the swapper's own status."""
    return SwapStatus(
        phase=SwapPhase(progress["phase"]), from_model=progress.get("from_model"), to_model=progress.get("to_model"),
        started_at=progress.get("started_at"), finished_at=progress.get("finished_at"),
        seconds=dict(progress.get("seconds") or {}), memory=dict(progress.get("memory") or {}),
        spilled_agents=int(progress.get("spilled_agents", 0)), spilled_bytes=int(progress.get("spilled_bytes", 0)),
        cancelled_requests=int(progress.get("cancelled_requests", 0)), load_stage=progress.get("load_stage"),
        load_done=int(progress.get("load_done", 0)), load_total=int(progress.get("load_total", 0)),
        error=progress.get("error"))


class RemoteSwap:
    """The last known status of the server's swap, refreshed by a task until the swap ends."""

    def __init__(self, status: SwapStatus) -> None:
        self.status = status
        self._task: asyncio.Task | None = None

    def follow(self, call: Callable[..., Awaitable[dict[str, Any]]]) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(call), name="semantic-attach-swap")

    async def _poll(self, call: Callable[..., Awaitable[dict[str, Any]]]) -> None:
        while self.status.running or self.status.phase is SwapPhase.IDLE:
            await asyncio.sleep(POLL_S)
            try:
                self.status = swap_status(await call("GET", "/v1/admin/swap"))
            except SemanticError as exc:  # the server restarting under the swap: keep asking
                log.info("swap progress: %s", exc)
