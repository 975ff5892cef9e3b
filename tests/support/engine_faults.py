"""ScriptedEngine variants that fail the way the real engine reports failures."""

from __future__ import annotations

from engine.errors import EngineUnavailableError
from engine.domain.requests import (
    EventSink,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PrefillEvent,
    QueuedEvent,
    TokenEvent,
    Usage,
)

from .scripted_engine import ScriptedEngine

POOL_MESSAGE = "KV pool exhausted: 8/8 blocks held by pinned or busy agents; evict or unpin agents, or raise the pool budget"


class PoolExhaustedEngine(ScriptedEngine):
    """Admission fails as the scheduler's admission (Admission._no_room) reports it: queued, then an error finish."""

    def _serve(self, request: GenerationRequest, sink: EventSink) -> None:
        sink(QueuedEvent(request.request_id, 1))
        usage = Usage(len(request.prompt_tokens), 0, 0, 0)
        sink(FinishEvent(request.request_id, FinishReason.ERROR, usage, error=POOL_MESSAGE,
                         error_type="rate_limit", retry_after_s=2))


class FailsMidStreamEngine(ScriptedEngine):
    """Emits ``partial`` and then fails, like a step that raised in the batch."""

    partial = "partial"

    def _serve(self, request: GenerationRequest, sink: EventSink) -> None:
        n = len(request.prompt_tokens)
        sink(PrefillEvent(request.request_id, 0, n, 0))
        for char in self.partial:
            sink(TokenEvent(request.request_id, ord(char), char))
        usage = Usage(n, 0, n, len(self.partial))
        sink(FinishEvent(request.request_id, FinishReason.ERROR, usage, error="engine step failed: boom",
                         error_type="api_error"))


class BusyEngine(ScriptedEngine):
    """Every agent is mid-generation as far as admin operations are concerned."""

    def delete_agent(self, agent_id: str) -> None:
        self._agent(agent_id)
        raise EngineUnavailableError(f"agent {agent_id!r} is generating", retry_after_s=1)
