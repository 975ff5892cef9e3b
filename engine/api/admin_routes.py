"""Admin: the engine snapshot as JSON, and evicting every idle agent at once.

Stats read the latest published snapshot, never the engine thread, so a
dashboard polling them cannot slow generation down.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Body, Query, Request
from pydantic import BaseModel, Field

from engine.domain.block_pool import PoolSnapshot
from engine.platform import blas_report
from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.snapshot import (
    AgentView,
    EngineSnapshot,
    ModelView,
    RankView,
    ThroughputView,
    TierView,
)
from engine.runtime.engine_thread.engine_ops import EvictIdle
from engine.runtime.memory_pressure import SAMPLE_INTERVAL_S, Watermarks
from engine.errors import EngineUnavailableError, InvalidRequestError

from .errors import ApiError
from .service import EngineService

if TYPE_CHECKING:
    from engine.resident_models import ResidentModels

router = APIRouter(tags=["admin"])


class ModelStats(BaseModel):
    model_id: str
    identity: str
    path: str | None
    architecture: str
    context_length: int
    cache_spec: dict[str, object]
    sampling_defaults: str = Field("", description="What requests that name no temperature sample with, and where "
                                   "that came from (generation_config.json, the fallback, or settings)")
    speculation: str = Field("", description="How decoding speculates: off, lookup (drafts from each agent's own "
                             "history), or 'draft model NAME' (--draft-model)")
    vision: str = Field("", description="Whether the model reads images: 'images (FAMILY, through mlx-vlm)', or "
                        "'no: WHY' (a text model, the vision extra not installed, a family not supported yet)")
    hot_kv: str = Field("", description="How the hot pool holds K/V: 'full precision', or the bits (--kv-bits) and "
                        "which layers keep full precision and why")


class BlockMap(BaseModel):
    """Per-block owner (agent id, or null when free) and layer group, indexed by block id."""

    owners: list[str | None]
    groups: list[int | None]
    holders: list[list[str]] = Field(default_factory=list, description="Every agent holding each block: a prefix "
                                     "block agents share (a fork, a shared system prompt) has several")


class GroupStats(BaseModel):
    """One layer group of the pool: what its blocks hold and what it uses now."""

    index: int
    kind: str = Field(description="global, sliding-W (a window of W tokens) or chunked-C (chunks of C tokens)")
    layers: list[int]
    geometry: dict[str, object] = Field(description="K/V heads, widths and dtype of its layers")
    block_bytes: int = Field(description="Bytes of one of its blocks (block_tokens tokens of every layer in it)")
    pool_blocks_per_block: int = Field(description="Pool blocks one of its blocks takes (the pool counts in the "
                                       "greatest common divisor of the groups' block sizes)")
    used_blocks: int = Field(description="Pool blocks it holds now (shared prefix blocks once)")
    used_bytes: int


class PoolStats(BaseModel):
    total_blocks: int
    used_blocks: int
    free_blocks: int
    shared_blocks: int
    block_bytes: int
    n_groups: int
    total_bytes: int
    used_bytes: int
    free_bytes: int
    pressure: float = Field(description="used_blocks / total_blocks")
    owner_blocks: dict[str, int] = Field(description="Blocks held per agent")
    groups: list[GroupStats] = Field(default_factory=list, description="Per layer group; a cool agent's quantized "
                                     "blocks are counted under cool_bytes in tiers, not here")
    block_map: BlockMap | None = Field(None, description="Only with ?blocks=true")


class Stats(BaseModel):
    status: str
    detail: str | None
    at: float = Field(description="Unix time the engine published this snapshot")
    model: ModelStats | None
    pool: PoolStats | None
    tiers: TierView
    throughput: ThroughputView
    agents: list[AgentView]
    backend: dict[str, object]
    ranks: list[RankView] = Field(default_factory=list, description="A sharded model's ranks (mlx.launch), rank 0 "
                                  "first, with each rank's MLX memory; empty when one process holds the model")
    memory: MemoryStats | None = Field(None, description="Memory against the watermarks; null where they are off "
                                       "(a rank of a sharded model)")
    models: list[dict[str, object]] = Field(
        default_factory=list, description="With --extra-model: every configured model (the default first), its "
        "state, weights and KV pool bytes, agents, requests routed to it and time waited for the device; the rest "
        "of this snapshot is the default model's")
    models_budget: dict[str, int] | None = Field(None, description="With --extra-model: models_budget_mb and "
                                                 "what the resident models hold of it, in bytes")
    stalled_s: float | None = Field(None, description="The watchdog: seconds the engine has made no step while "
                                    "work waits (the snapshot above is then that old); null while it steps")


class MemoryStats(BaseModel):
    """The machine's memory against the engine's watermarks (bytes), and what this process and MLX hold."""

    pressure: Literal["normal", "soft", "hard"] = Field(
        description="normal; soft: idle agents are cooled and spilled and new turns admitted as memory allows; "
                    "hard: new requests are refused (Anthropic 529, OpenAI 503) until memory falls")
    system_total_bytes: int
    system_used_bytes: int = Field(description="Memory the whole machine has in use (total minus available): "
                                   "what the watermarks are compared with")
    system_available_bytes: int
    process_bytes: int = Field(description="This process: phys_footprint on macOS, resident set size elsewhere")
    mlx_active_bytes: int = Field(description="MLX arrays alive now (weights, KV pool, activations)")
    mlx_cache_bytes: int = Field(description="Freed buffers MLX keeps for reuse (given back under pressure)")
    soft_watermark_bytes: int
    hard_watermark_bytes: int


class MemoryWatermarksRequest(BaseModel):
    soft_limit_mb: float | None = Field(None, ge=1, le=1e9, description="New soft watermark in MiB (unchanged when "
                                        "absent)")
    hard_limit_mb: float | None = Field(None, ge=1, le=1e9, description="New hard watermark in MiB (unchanged when "
                                        "absent)")


class EvictIdleRequest(BaseModel):
    tier: Literal["warm", "cold"] = Field("warm", description="warm keeps the caches on disk; cold drops them")


class EvictIdleResponse(BaseModel):
    evicted: int


ERROR_SCHEMA = {"type": "object", "required": ["type", "error"],
                "properties": {"type": {"const": "error"}, "error": {"type": "object"}}}


def _error_doc(description: str) -> dict[str, object]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_SCHEMA}}}


@functools.cache
def _blas() -> dict[str, str | None]:
    # Which BLAS is mapped cannot change after start-up; reading /proc/self/maps once is enough.
    return blas_report()


def _model_stats(view: ModelView) -> ModelStats:
    return ModelStats(model_id=view.model_id, identity=view.identity, path=view.path,
                      architecture=view.architecture, context_length=view.context_length, cache_spec=view.spec,
                      sampling_defaults=view.sampling_defaults, speculation=view.speculation, vision=view.vision,
                      hot_kv=view.hot_kv)


def _pool_stats(pool: PoolSnapshot, with_blocks: bool, spec: dict | None = None, cool_bytes: int = 0) -> PoolStats:
    block_map = (BlockMap(owners=list(pool.block_owner), groups=list(pool.block_group),
                          holders=[list(h) for h in pool.block_holder_ids]) if with_blocks else None)
    return PoolStats(
        total_blocks=pool.total_blocks, used_blocks=pool.used_blocks, free_blocks=pool.free_blocks,
        shared_blocks=pool.shared_blocks, block_bytes=pool.block_bytes, n_groups=pool.n_groups,
        total_bytes=pool.total_bytes, used_bytes=pool.used_bytes, free_bytes=pool.free_bytes,
        pressure=pool.pressure, owner_blocks=dict(pool.owner_blocks),
        groups=group_stats(pool, spec, cool_bytes) if spec else [], block_map=block_map,
    )


def group_stats(pool: PoolSnapshot, spec: dict, cool_bytes: int) -> list[GroupStats]:
    """Each group's blocks in use, from the pool's per-block groups (cool agents pay under group 0)."""
    held = Counter(g for g in pool.block_group if g is not None)
    held[0] -= cool_bytes // pool.block_bytes
    own = {k: spec[k] for k in ("n_kv_heads", "head_dim", "v_head_dim", "dtype")}
    out = []
    for group in spec["groups"]:
        geometry = group.get("geometry") or own
        block_bytes = group.get("block_bytes", pool.block_bytes)
        out.append(GroupStats(
            index=group["index"], kind=group["kind"], layers=list(group["layers"]), geometry=dict(geometry),
            block_bytes=block_bytes, pool_blocks_per_block=block_bytes // pool.block_bytes,
            used_blocks=held[group["index"]], used_bytes=held[group["index"]] * pool.block_bytes))
    return out


def build_stats(service: EngineService, with_blocks: bool = False) -> Stats:
    snapshot = service.snapshot() or EngineSnapshot(status="starting", model=None, pool=None)
    return Stats(
        status=snapshot.status,
        detail=snapshot.detail or service.status_detail,
        at=snapshot.at,
        model=_model_stats(snapshot.model) if snapshot.model else None,
        pool=_pool_stats(snapshot.pool, with_blocks, snapshot.model.spec if snapshot.model else None,
                         snapshot.tiers.cool_bytes) if snapshot.pool else None,
        tiers=snapshot.tiers,
        throughput=snapshot.throughput,
        agents=list(snapshot.agents),
        backend={**snapshot.backend, **_blas()},
        ranks=list(snapshot.ranks),
        memory=MemoryStats(**snapshot.memory) if snapshot.memory else None,
        models=service.models.describe() if service.models is not None else [],
        models_budget=service.models.budget() if service.models is not None else None,
        stalled_s=service.stalled_for(),
    )


@router.post("/v1/admin/models/{alias}/load", summary="Load a configured model now (--extra-model)",
             responses={404: _error_doc("No such configured model"), 503: _error_doc("It does not fit")})
async def load_model_now(alias: str, request: Request) -> dict[str, object]:
    service: EngineService = request.app.state.service
    models = _configured_models(service, alias)
    await service.in_thread(models.engine_for, alias, False)
    return next(row for row in models.describe() if row["alias"] == alias)


@router.post("/v1/admin/models/{alias}/unload", summary="Unload a configured model now; its agents go to disk",
             responses={404: _error_doc("No such configured model"), 409: _error_doc("Serving, or the default")})
async def unload_model_now(alias: str, request: Request) -> dict[str, object]:
    service: EngineService = request.app.state.service
    models = _configured_models(service, alias)
    if alias == models.routes.default.alias:
        raise InvalidRequestError("the default model is not unloaded here: swap it (POST /v1/admin/swap) or set "
                                  "idle_unload_s", field="alias")
    if not await service.in_thread(models.unload, alias, "asked by the admin API"):
        raise ApiError(409, f"model {alias} is not resident, or is serving a turn; try again when it is idle")
    return next(row for row in models.describe() if row["alias"] == alias)


@router.post("/v1/admin/models/{alias}/pin", summary="Pin a configured model (never unloaded) or unpin it",
             responses={400: _error_doc("The default model"), 404: _error_doc("No such configured model")})
async def pin_model(alias: str, request: Request,
                    pinned: bool = Query(True, description="false unpins it")) -> dict[str, object]:
    service: EngineService = request.app.state.service
    models = _configured_models(service, alias)
    if alias == models.routes.default.alias:
        raise InvalidRequestError("the default model is always resident; it is not pinned or unpinned",
                                  field="alias")
    models.set_pinned(alias, pinned)
    return next(row for row in models.describe() if row["alias"] == alias)


def _configured_models(service: EngineService, alias: str) -> "ResidentModels":
    models = service.models
    known = [slot.alias for slot in models.routes.slots] if models is not None else []
    if models is None or alias not in known:
        raise ApiError(404, f"no configured model {alias!r}; configured: {', '.join(known) or 'only --model'}")
    return models


@router.get("/v1/stats", response_model=Stats, summary="Engine snapshot: model, pool, tiers, throughput, agents")
async def stats(request: Request, blocks: bool = Query(False, description="Include the per-block map")) -> Stats:
    return build_stats(request.app.state.service, blocks)


@router.put("/v1/admin/memory", response_model=MemoryStats, summary="Change the memory watermarks while running",
            responses={400: _error_doc("soft above hard"), 503: _error_doc("No engine running, or watermarks off")})
async def set_memory_watermarks(request: Request, body: MemoryWatermarksRequest) -> MemoryStats:
    """The watermarks apply from the engine's next sample (a tenth of a second); the answer is the memory as
    then judged. Not kept across a restart or a model swap: the settings' memory_soft_limit_mb /
    memory_hard_limit_mb are."""
    service: EngineService = request.app.state.service
    engine = service.engine
    watch = engine.memory
    if watch is None:
        raise EngineUnavailableError("memory watermarks are off in this process (a rank of a sharded model)")
    soft = int(body.soft_limit_mb * 2**20) if body.soft_limit_mb is not None else watch.watermarks.soft
    hard = int(body.hard_limit_mb * 2**20) if body.hard_limit_mb is not None else watch.watermarks.hard
    if soft > hard:
        raise InvalidRequestError(f"the soft watermark ({soft / 2**20:.0f} MiB) would exceed the hard one "
                                  f"({hard / 2**20:.0f} MiB)", field="soft_limit_mb")
    engine.set_memory_watermarks(Watermarks(soft, hard))
    await asyncio.sleep(SAMPLE_INTERVAL_S * 2)  # the engine samples at most ten times a second
    snapshot = await service.in_thread(engine.fresh_snapshot)
    if not snapshot.memory:
        raise EngineUnavailableError("the engine has not published a memory reading yet; retry shortly", retry_after_s=1)
    return MemoryStats(**snapshot.memory)


@router.post("/v1/admin/evict-idle", response_model=EvictIdleResponse, summary="Evict every idle, unpinned hot agent",
             responses={400: _error_doc("Invalid tier"), 503: _error_doc("No engine running")})
async def evict_idle(request: Request, body: EvictIdleRequest | None = Body(None)) -> EvictIdleResponse:
    tier = Tier((body or EvictIdleRequest()).tier)
    service: EngineService = request.app.state.service
    evicted = await service.call(EvictIdle(tier))
    # Republish now, so a GET /v1/stats right after this shows the evictions.
    await service.in_thread(service.engine.fresh_snapshot)
    return EvictIdleResponse(evicted=evicted)
