"""Model hot-swap over HTTP: POST /v1/admin/swap starts one, GET reports its progress."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from engine.swap import SwapStatus

from .errors import ApiError
from .service import EngineService

router = APIRouter(tags=["admin"])


class SwapRequest(BaseModel):
    model: str = Field(min_length=1, max_length=4096, description="Registry id or alias, MLX folder, .gguf file or hub id")
    grace_s: float | None = Field(None, ge=0, le=3600, description="Seconds running turns may finish before they are cancelled (default: swap_grace_s)")


class SwapProgress(BaseModel):
    phase: str = Field(description="idle, draining, spilling, unloading, loading, rebuilding, rolling_back, done, failed, unloaded")
    running: bool
    from_model: str | None
    to_model: str | None
    started_at: float | None
    finished_at: float | None
    seconds: dict[str, float] = Field(description="Seconds spent per phase")
    total_seconds: float
    memory: dict[str, int] = Field(description="Active MLX memory in bytes before, after unloading, and after loading")
    spilled_agents: int
    spilled_bytes: int
    cancelled_requests: int
    load_stage: str | None
    load_done: int
    load_total: int
    error: str | None


def progress_of(status: SwapStatus) -> SwapProgress:
    return SwapProgress(
        phase=status.phase.value, running=status.running, from_model=status.from_model, to_model=status.to_model,
        started_at=status.started_at, finished_at=status.finished_at, seconds=dict(status.seconds),
        total_seconds=status.total_seconds, memory=dict(status.memory), spilled_agents=status.spilled_agents,
        spilled_bytes=status.spilled_bytes, cancelled_requests=status.cancelled_requests,
        load_stage=status.load_stage, load_done=status.load_done, load_total=status.load_total, error=status.error,
    )


def _swapper(service: EngineService):
    if service.swapper is None:
        shard = service.engine.loaded.shard if service.is_ready else None
        if shard is not None:
            raise ApiError(400, f"model swaps are not available while the model is sharded across {shard[1]} ranks; "
                                "restart the ranks with the other model")
        raise ApiError(400, "model swaps are not enabled in this process")
    return service.swapper


@router.post("/v1/admin/swap", response_model=SwapProgress, status_code=202,
             summary="Swap the loaded model; agents' caches are spilled to disk and kept per model")
async def start_swap(request: Request, body: SwapRequest) -> SwapProgress:
    service: EngineService = request.app.state.service
    swapper = _swapper(service)
    # Checked before anything is drained or spilled, on a worker thread (it reads the disk):
    # a folder must be an MLX model folder, a .gguf a file; hub ids are tried at load time.
    await service.in_thread(_known_or_added, service, body.model)
    grace = body.grace_s if body.grace_s is not None else service.settings.swap_grace_s
    return progress_of(swapper.request(body.model, grace))


def _known_or_added(service: EngineService, model: str) -> None:
    if service.registry.find(model) is None:
        service.registry.add(model)  # raises ModelLoadError (a 400) for what cannot be a model


@router.get("/v1/admin/swap", response_model=SwapProgress, summary="Progress of the current or last swap")
async def swap_progress(request: Request) -> SwapProgress:
    return progress_of(_swapper(request.app.state.service).status)
