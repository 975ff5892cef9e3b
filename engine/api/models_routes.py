"""GET /v1/models: one listing both SDKs parse.

Anthropic's and OpenAI's list shapes do not collide (``type``/``display_name``/
``created_at``/``first_id`` vs ``object``/``created``/``owned_by``), so every
entry and the envelope carry the union of both. The list is the model
registry: packaged models, imported GGUF folders and folders or hub ids the
user named, each with size, architecture, cache layout and whether it is
present and loaded; ``claude-*`` names are accepted by the messages endpoint
(they mean the loaded model) but never advertised here.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from engine.errors import EngineUnavailableError
from engine.models.packaged import PACKAGED_MODELS
from engine.models.registry import RegistryEntry
from engine.runtime.engine_thread.engine import Engine

from .errors import ApiError, error_body
from .service import EngineService

router = APIRouter(tags=["models"])

# Local models have no release date; both SDKs require one, so all share a fixed one.
CREATED_AT = "2026-01-01T00:00:00Z"
CREATED = 1767225600  # CREATED_AT as Unix seconds
OWNER = "semantic"


class ModelEntry(BaseModel):
    id: str
    type: Literal["model"] = "model"
    object: Literal["model"] = "model"
    display_name: str
    created_at: str = CREATED_AT
    created: int = CREATED
    owned_by: str = OWNER
    lifecycle: Literal["active"] = "active"
    loaded: bool = Field(description="True for the model the engine is serving now.")
    identity: str | None = Field(None, description="name@digest of the loaded weights; caches are keyed by it.")
    max_input_tokens: int | None = None
    description: str | None = None
    kind: str | None = Field(None, description="packaged, imported, folder or hub")
    present: bool | None = Field(None, description="Weights (or their package) are on this machine.")
    size_bytes: int | None = None
    architecture: str | None = None
    cache_spec: dict | None = Field(None, description="KV layout: exact for the loaded model, estimated from config.json otherwise.")
    aliases: list[str] = Field(default_factory=list)
    # With several resident models (--extra-model): each configured one, under its alias.
    state: str | None = Field(None, description="resident, loading, unloading, unloaded or failed (configured "
                                                "models only)")
    role: str | None = Field(None, description="main, or side (Claude Code's haiku tier and side requests)")
    default: bool | None = Field(None, description="Requests that name no resident model go to it")
    pinned: bool | None = None
    source: str | None = Field(None, description="What the model was configured as (--model, --extra-model)")
    weights_bytes: int | None = Field(None, description="Its weights' bytes while resident")
    kv_pool_bytes: int | None = Field(None, description="Its KV pool's budget while resident")
    kv_used_bytes: int | None = Field(None, description="Of the pool, what agents' caches hold now")
    requests_routed: int | None = None
    error: str | None = Field(None, description="Why its last load failed")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelEntry]
    first_id: str | None
    last_id: str | None
    has_more: bool = False


def _entry(item: RegistryEntry, engine: Engine | None) -> ModelEntry:
    packaged = next((m for m in PACKAGED_MODELS if m.answers_to(item.model_id)), None)
    loaded = engine is not None and item.loaded
    return ModelEntry(
        id=item.model_id,
        display_name=packaged.display_name if packaged else item.model_id,
        loaded=loaded,
        identity=engine.loaded.identity.key if loaded and engine else None,
        max_input_tokens=engine.context_length if loaded and engine else None,
        description=item.description or None,
        kind=item.kind,
        present=item.present,
        size_bytes=item.size_bytes,
        architecture=item.architecture,
        cache_spec=item.cache_spec,
        aliases=list(item.aliases),
    )


def model_entries(service: EngineService) -> list[ModelEntry]:
    """Every registry entry, the loaded model first; with extra models, every configured model first."""
    engine = _running_engine(service)
    entries = [_entry(item, engine) for item in service.registry.entries()]
    if service.models is not None:
        configured = [_configured(row) for row in service.models.describe()]
        names = {e.id for e in configured} | {e.source for e in configured}
        return configured + [e for e in entries if e.id not in names and not e.loaded]
    return sorted(entries, key=lambda e: not e.loaded)


def _configured(row: dict) -> ModelEntry:
    resident = row["state"] == "resident"
    return ModelEntry(
        id=row["alias"], display_name=row["model_id"] or row["alias"], loaded=resident,
        identity=row["identity"], kind="configured", present=True, state=row["state"], role=row["role"],
        default=row["default"], pinned=row["pinned"], source=row["source"],
        weights_bytes=row["weights_bytes"] if resident else None, kv_pool_bytes=row["pool_bytes"] if resident else None,
        kv_used_bytes=row["kv_used_bytes"] if resident else None, requests_routed=row["requests_routed"],
        error=row["error"], aliases=[row["source"]] if row["source"] != row["alias"] else [],
    )


def _running_engine(service: EngineService) -> Engine | None:
    try:
        return service.engine
    except EngineUnavailableError:
        return None


def _find(entries: list[ModelEntry], model_id: str) -> ModelEntry | None:
    wanted = model_id.casefold()
    for entry in entries:
        if wanted in (entry.id.casefold(), (entry.identity or "").casefold()):
            return entry
    packaged = next((m for m in PACKAGED_MODELS if m.answers_to(model_id)), None)
    return next((e for e in entries if packaged and e.id == packaged.alias), None)


def _wire_protocol(request: Request) -> str:
    # The models endpoints are shared; as in errors.protocol_of for the list,
    # Anthropic clients announce themselves with anthropic-version or x-api-key.
    headers = request.headers
    return "anthropic" if "anthropic-version" in headers or "x-api-key" in headers else "openai"


@router.get("/v1/models", response_model=ModelList, summary="Models (Anthropic and OpenAI list shapes at once)")
async def list_models(request: Request) -> ModelList:
    service = request.app.state.service
    entries = await service.in_thread(model_entries, service)  # may read the models folder
    return ModelList(data=entries, first_id=entries[0].id if entries else None,
                     last_id=entries[-1].id if entries else None)


@router.get(
    "/v1/models/{model_id:path}",
    response_model=ModelEntry,
    summary="One model by id, alias or identity key",
    responses={404: {"description": "No such model, in the caller's protocol's error shape",
                     "content": {"application/json": {"schema": {"type": "object"}}}}},
)
async def get_model(model_id: str, request: Request) -> ModelEntry | JSONResponse:
    service = request.app.state.service
    entry = _find(await service.in_thread(model_entries, service), model_id)
    if entry is None:
        error = ApiError(404, f"model {model_id!r} not found; GET /v1/models lists the available ones")
        return JSONResponse(error_body(_wire_protocol(request), error), status_code=404)
    return entry
