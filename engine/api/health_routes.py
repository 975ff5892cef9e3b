"""Liveness and readiness probes; both stay open when an API key is set.

Liveness only says the process answers HTTP (a model import can take a
while and must not get the process restarted); readiness says requests
will be served now.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from engine.errors import EngineUnavailableError
from engine.runtime.engine_thread.snapshot import EngineSnapshot

from .service import EngineService

router = APIRouter(tags=["health"])

RETRY_AFTER_S = 5
STOPPED_DETAIL = {"stopping": "the engine is shutting down", "stopped": "the engine has stopped"}


class Live(BaseModel):
    status: str = "ok"


class Ready(BaseModel):
    status: str
    model: str | None = None
    identity: str | None = None
    detail: str | None = None


@router.get("/health/live", response_model=Live, summary="200 whenever the process serves HTTP")
async def live() -> Live:
    return Live()


@router.get(
    "/health/ready",
    response_model=Ready,
    summary="200 with the model when requests are served, else 503 with retry-after",
    responses={503: {"model": Ready, "description": "Loading, swapping, stopping or failed; see detail"}},
)
async def ready(request: Request) -> Ready | JSONResponse:
    service: EngineService = request.app.state.service
    try:
        loaded = service.engine.loaded
    except EngineUnavailableError as exc:
        return _not_ready(service, str(exc))
    stalled = service.stalled_for()
    if stalled is not None:
        return _not_ready(service, f"engine stalled: no step for {stalled:.0f} s while requests wait", "stalled")
    return Ready(status="ready", model=loaded.model_id, identity=loaded.identity.key)


def _not_ready(service: EngineService, reason: str, status: str | None = None) -> JSONResponse:
    status = status or _status(service.snapshot())
    detail = reason if status == "stalled" else service.status_detail or STOPPED_DETAIL.get(status, reason)
    body = Ready(status=status, detail=detail)
    return JSONResponse(body.model_dump(), status_code=503, headers={"retry-after": str(RETRY_AFTER_S)})


def _status(snapshot: EngineSnapshot | None) -> str:
    if snapshot is None:
        return "starting"
    # A snapshot that still says ready was published before the engine thread exited.
    return "stopped" if snapshot.status == "ready" else snapshot.status
