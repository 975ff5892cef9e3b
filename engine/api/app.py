"""The FastAPI application, built around one EngineService.

The same app runs headless (``semantic --serve``) and inside the workbench's
event loop; it never touches MLX itself.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import SemanticError

from .errors import ApiError, error_response, from_domain, internal_error
from .json_guard import JsonGuardMiddleware
from .middleware import ApiKeyMiddleware, BodyLimitMiddleware
from .recorder import RecorderMiddleware, TraceWriter
from .service import EngineService


def create_app(service: EngineService) -> FastAPI:
    app = FastAPI(
        title="semantic",
        version="0.1.0",
        description="Local multi-agent LLM serving on MLX: Anthropic Messages, OpenAI chat completions, "
        "a direct per-agent API, admin, health and Prometheus metrics.",
    )
    app.state.service = service
    _install_error_handlers(app)
    _include_routers(app, service)
    settings = service.settings
    # Added first, so it runs last: bodies are read only once the key and the size passed.
    app.add_middleware(JsonGuardMiddleware)
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key.get_secret_value() if settings.api_key else None)
    # An imported agent file is a cache, not a JSON body: it is bounded by the disk budget instead.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                       per_path={"/v1/agents/import": settings.disk_budget_bytes})
    if settings.record_requests is not None:
        # Outermost: it records every generation POST, refused ones too, with the status sent.
        app.state.trace_writer = TraceWriter(settings.record_requests)
        app.add_middleware(RecorderMiddleware, writer=app.state.trace_writer)
    return app


def _include_routers(app: FastAPI, service: EngineService) -> None:
    from . import (
        admin_routes,
        agents_routes,
        anthropic_routes,
        branch_routes,
        completions_routes,
        health_routes,
        metrics,
        models_routes,
        openai_routes,
        responses_routes,
        stream_routes,
        swap_routes,
        transfer_routes,
    )
    from .live_stream import StreamHub

    recorder = metrics.MetricsRecorder(service)
    app.state.metrics = recorder
    app.state.stream_hub = StreamHub(service, service.settings.stream_max_clients)
    recorder.registry.register(metrics.StreamCollector(app.state.stream_hub))
    for module in (anthropic_routes, openai_routes, completions_routes, responses_routes, models_routes,
                   transfer_routes, agents_routes, branch_routes, admin_routes, stream_routes, swap_routes,
                   health_routes):
        app.include_router(module.router)
    app.include_router(metrics.router)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(SemanticError)
    async def domain_error(request: Request, exc: SemanticError) -> JSONResponse:
        return error_response(request, from_domain(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, ApiError(400, _describe(exc), param=_first_field(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route for {request.method} {request.url.path}"
        return error_response(request, ApiError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request, internal_error(exc, f"{request.method} {request.url.path}"))


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        if error.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}")
        else:
            parts.append(f"{location or 'body'}: {error.get('msg')}")
    return "; ".join(parts) or "invalid request"


def _first_field(exc: RequestValidationError) -> str | None:
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            continue  # its location is a character offset, not a field
        location = [str(p) for p in error.get("loc", ()) if p != "body"]
        if location:
            return ".".join(location)
    return None
