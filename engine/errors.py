"""Domain errors. Adapters map them onto their protocol's error shapes."""

from __future__ import annotations


class SemanticError(Exception):
    """Base of every error semantic raises on purpose."""


class InvalidRequestError(SemanticError):
    """The request itself is wrong (bad field, empty prompt, bad agent id)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLongError(InvalidRequestError):
    """A prompt longer than the model's context. The message wording is what Claude Code matches."""

    def __init__(self, n_tokens: int, limit: int) -> None:
        super().__init__(f"prompt is too long: {n_tokens} tokens > {limit} maximum", field="messages")
        self.n_tokens = n_tokens
        self.limit = limit


class ImageTooLargeError(InvalidRequestError):
    """An image over the server's byte limit (413, naming the field)."""


class AgentNotFoundError(SemanticError):
    def __init__(self, agent_id: str, detail: str | None = None) -> None:
        super().__init__(detail or f"agent {agent_id!r} does not exist")
        self.agent_id = agent_id


class AgentExistsError(SemanticError):
    def __init__(self, agent_id: str) -> None:
        super().__init__(f"agent {agent_id!r} already exists")
        self.agent_id = agent_id


class AgentModelMismatchError(SemanticError):
    """An agent's cache belongs to another model or cache layout than the target (a conflict, 409)."""

    def __init__(self, agent_id: str, made_by: str, target: str) -> None:
        super().__init__(f"agent {agent_id!r} was cached by {made_by}, but the target is {target}; "
                         "a cache only resumes under the model and cache layout that made it")
        self.agent_id = agent_id
        self.made_by = made_by
        self.target = target


class InvalidAgentFileError(InvalidRequestError):
    """A file offered for import is not a whole, untampered agent export."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="file")


class PoolExhaustedError(SemanticError):
    """Admission needs more blocks than eviction can free right now."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLargeForPoolError(InvalidRequestError):
    """A single request that could never fit in the pool, even if it were empty."""


class ModelLoadError(SemanticError):
    """A model could not be found, imported or loaded."""


class UnsupportedModelError(ModelLoadError):
    """A GGUF architecture or tensor type the importer does not handle."""


class CacheCorruptionError(SemanticError):
    """A persisted cache failed validation (checksum, format, model, spec)."""


class CachePersistenceError(SemanticError):
    """A cache could not be written (disk full, unwritable directory)."""


class EngineUnavailableError(SemanticError):
    """The engine is swapping models, shutting down or has no model loaded."""

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelsBudgetError(EngineUnavailableError):
    """A model a request needs does not fit beside the resident ones (their weights and KV pools count against
    models_budget_mb): the message says what is resident and how much each holds (503, retry-after)."""


class MemoryPressureError(SemanticError):
    """The machine's memory is past the hard watermark: new requests are refused until it falls (Anthropic 529
    overloaded_error, OpenAI 503, with retry-after)."""

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFullError(SemanticError):
    """Too many turns already wait for the engine: come back later (429 with retry-after)."""

    def __init__(self, message: str, retry_after_s: int = 2) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelSwapError(SemanticError):
    """A model swap failed; the previous model is serving again."""
