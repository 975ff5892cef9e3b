"""Moving an agent between servers: ``GET /v1/agents/{id}/export`` and ``POST /v1/agents/import``.

The file is one agent cache file (engine/store/agent_export.py): every block
the agent needs, its tokens, its conversation when it has one, the model and
cache layout that made it, one checksum. The same files move offline with
``semantic agents export|import``.

Export first has the engine write a hot agent's warm file (the agent stays
hot; the write runs on the store's I/O thread and is awaited here, not on the
engine thread), then builds the export from that file on a worker thread.
Import streams the upload to a temporary file, validates and installs it on a
worker thread (nothing changes unless every check passes), then has the
engine index it as a warm agent; its next turn reads it back.

Errors: unknown agent 404, a damaged or foreign-model file 400 / 409 naming
both models, an id in use 409 (``?replace=true`` replaces an idle agent).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from engine.errors import CacheCorruptionError, InvalidAgentFileError
from engine.store.agent_export import ExportSummary, export_agent, import_agent
from engine.store.cache_file import CacheHeader, read_header
from engine.store.agents_on_disk import ModelKey
from engine.store.temp_files import temp_prefix
from engine.runtime.engine_thread.engine_ops import AdoptAgent, CheckImport, WriteAgent

from .agents_routes import MODEL_QUERY, _current, _locate, agent_body, conversations, fresh_snapshot, path_agent_id
from .agents_schemas import ImportedOut, errors
from engine.domain.agent_ids import validate_agent_id
from .service import EngineService
from engine.models.loaded import LoadedModel

router = APIRouter(tags=["agents"])

MEDIA_TYPE = "application/octet-stream"
SUFFIX = ".agent.safetensors"


def _model_key(loaded: LoadedModel) -> ModelKey:
    return ModelKey.of_model(loaded.identity, loaded.spec)


@router.get("/v1/agents/{agent_id}/export", response_class=FileResponse,
            summary="The agent as one file: its cache blocks, tokens, conversation, model identity and checksum",
            responses={200: {"content": {MEDIA_TYPE: {}}, "description": "The agent file"},
                       **errors(400, 404, 503)})
async def export(request: Request, agent_id: str = Depends(path_agent_id),
                 model: str | None = MODEL_QUERY) -> FileResponse:
    service: EngineService = request.app.state.service
    found = await _locate(request, agent_id, model)  # the model that holds its cache (the default first)
    engine = found.engine if found.engine is not None else service.engine
    write = await service.call_on(engine, WriteAgent(agent_id))
    if write is not None:
        await asyncio.wrap_future(write)  # the store's I/O thread writes the warm file
    summary = await asyncio.to_thread(_export_to_temp, service.settings.cache_dir, agent_id,
                                      _model_key(engine.loaded))
    return FileResponse(summary.path, media_type=MEDIA_TYPE, filename=f"{agent_id}{SUFFIX}",
                        headers={"x-semantic-tokens": str(summary.n_tokens)},
                        background=BackgroundTask(asyncio.to_thread, summary.path.unlink, missing_ok=True))


def _export_to_temp(cache_dir: Path, agent_id: str, key: ModelKey) -> ExportSummary:
    """The export, written to a private temporary file beside the caches (worker thread)."""
    fd, name = tempfile.mkstemp(prefix=temp_prefix("export"), suffix=SUFFIX, dir=cache_dir)
    os.close(fd)
    out = Path(name)
    try:
        return export_agent(cache_dir, agent_id, out, key)
    except BaseException:
        out.unlink(missing_ok=True)
        raise


@router.post("/v1/agents/import", status_code=201, response_model=ImportedOut,
             summary="Install an exported agent file (the request body) as a warm agent of this server",
             openapi_extra={"requestBody": {"content": {MEDIA_TYPE: {"schema": {"type": "string",
                                                                                 "format": "binary"}}},
                                            "required": True}},
             responses=errors(400, 409, 503))
async def import_file(
    request: Request,
    as_id: str | None = Query(None, alias="as", description="Install under this agent id instead of the file's"),
    replace: bool = Query(False, description="Replace an idle agent of the same id"),
    model: str | None = Query(None, description="With several resident models: the alias of the model to install "
                                                "it into (absent: the serving model whose weights made the file, "
                                                "else the default model)"),
) -> dict[str, Any]:
    service: EngineService = request.app.state.service
    new_id = validate_agent_id(as_id, "as") if as_id is not None else None
    upload = await _receive(request, service.settings.cache_dir)
    try:
        header = await asyncio.to_thread(_header_of, upload)
        alias, engine = service.import_target(ModelKey.of_header(header), model)
        target = new_id or header.agent_id
        await service.call_on(engine, CheckImport(target, replace))
        summary = await asyncio.to_thread(import_agent, service.settings.cache_dir, upload, new_id,
                                          _model_key(engine.loaded), replace_existing=replace)
    finally:
        await asyncio.to_thread(upload.unlink, missing_ok=True)
    conversations(request).forget_loaded(summary.agent_id)  # the file on disk is the new truth
    await service.call_on(engine, AdoptAgent(summary.path))
    if engine is service.engine:
        agent = await _current(request, summary.agent_id, fresh=True)
    else:  # an extra model's: its own snapshot, after the adoption
        snapshot = await fresh_snapshot(service, engine)
        agent = agent_body(snapshot.agent(summary.agent_id) if snapshot is not None else None,
                           conversations(request).get(summary.agent_id), alias)
    return {"agent": agent, "tokens": summary.n_tokens, "bytes": summary.nbytes, "model": summary.model,
            "conversation_turns": summary.conversation_turns, "replaced": summary.replaced}


def _header_of(path: Path) -> CacheHeader:
    try:
        return read_header(path)
    except CacheCorruptionError as exc:
        raise InvalidAgentFileError(f"not an agent file: {exc}") from None


async def _receive(request: Request, directory: Path) -> Path:
    """The request body, streamed to a private temporary file beside the caches."""
    fd, name = await asyncio.to_thread(tempfile.mkstemp, prefix=temp_prefix("import"), suffix=SUFFIX, dir=directory)
    path = Path(name)
    out = os.fdopen(fd, "wb")  # wraps the descriptor; no disk access
    try:
        async for chunk in request.stream():
            if chunk:
                await asyncio.to_thread(out.write, chunk)
        await asyncio.to_thread(out.close)
    except BaseException:
        await asyncio.to_thread(out.close)
        await asyncio.to_thread(path.unlink, missing_ok=True)
        raise
    return path
