"""Error shapes of the two protocols, and how domain errors map onto HTTP statuses."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.errors import (
    AgentExistsError,
    AgentModelMismatchError,
    AgentNotFoundError,
    CachePersistenceError,
    EngineUnavailableError,
    MemoryPressureError,
    ImageTooLargeError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    ModelSwapError,
    PoolExhaustedError,
    QueueFullError,
    SemanticError,
)

log = logging.getLogger("semantic.api")

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


# Not frozen: Starlette clears ``__traceback__`` on handled exceptions, which a
# frozen dataclass refuses; eq=False keeps exceptions hashable by identity.
@dataclass(slots=True, eq=False)
class ApiError(Exception):
    status: int
    message: str
    retry_after_s: int | None = None
    param: str | None = None
    request_id: str | None = None
    # OpenAI's machine-readable ``code`` (``context_length_exceeded``: clients shorten their history on it).
    code: str | None = None


def internal_error(exc: BaseException, where: str) -> ApiError:
    """A 500 naming only a fresh request id; the traceback goes to the log under that id.

    Never the exception's text: it can hold paths, prompts or other agents' data.
    """
    request_id = f"req_{secrets.token_hex(12)}"
    log.error("unhandled error in %s (request id %s)", where, request_id, exc_info=exc,
              extra={"request_id": request_id})
    return ApiError(500, f"internal server error (request id {request_id})", request_id=request_id)


def from_domain(exc: SemanticError) -> ApiError:
    """The HTTP status and message for a domain error."""
    if isinstance(exc, PromptTooLongError):
        return ApiError(400, str(exc), param=exc.field, code="context_length_exceeded")
    if isinstance(exc, ImageTooLargeError):
        return ApiError(413, str(exc), param=exc.field)
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.field)
    if isinstance(exc, AgentNotFoundError):
        return ApiError(404, str(exc))
    if isinstance(exc, (AgentExistsError, AgentModelMismatchError)):
        return ApiError(409, str(exc))
    if isinstance(exc, (PoolExhaustedError, QueueFullError)):
        return ApiError(429, str(exc), retry_after_s=exc.retry_after_s)
    if isinstance(exc, MemoryPressureError):
        return ApiError(529, str(exc), retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineUnavailableError):
        return ApiError(503, str(exc), retry_after_s=exc.retry_after_s)
    if isinstance(exc, (ModelLoadError, ModelSwapError)):
        return ApiError(400, str(exc))
    if isinstance(exc, CachePersistenceError):
        return ApiError(500, str(exc))
    return ApiError(500, str(exc))


# Paths whose errors take OpenAI's shape (the middleware's early refusals use it too).
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def protocol_of(request: Request) -> str:
    path = request.url.path
    if path.startswith(OPENAI_PATHS):
        return "openai"
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path == "/v1/models" and "anthropic-version" not in request.headers and "x-api-key" not in request.headers:
        return "openai"
    return "anthropic"


def error_body(protocol: str, error: ApiError) -> dict:
    if protocol == "openai":
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        if error.status == 401:
            kind = "authentication_error"
        elif error.status == 429:
            kind = "rate_limit_error"
        return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(error.status, "api_error"), "message": error.message}}


def error_response(request: Request, error: ApiError) -> JSONResponse:
    headers = {}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(error.retry_after_s)
    if error.request_id is not None:
        headers["request-id"] = error.request_id
    protocol = protocol_of(request)
    # 529 is Anthropic's "overloaded"; OpenAI clients know 503 for the same thing.
    status = 503 if error.status == 529 and protocol == "openai" else error.status
    return JSONResponse(error_body(protocol, error), status_code=status, headers=headers)


def stream_error_payload(error: ApiError) -> dict:
    """An Anthropic ``event: error`` payload for failures after the 200 was sent."""
    return error_body("anthropic", error)
