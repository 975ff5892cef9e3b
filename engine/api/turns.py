"""What both chat protocols share: rendering a conversation into a request,
and turning engine events into text and tool-call pieces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.runtime.requests import FinishEvent, FinishReason, GenerationRequest, SamplingParams, TokenEvent

from .async_turn import AsyncTurn
from .chat import Conversation, ToolCall
from .identity import AgentIdentity
from .rendering import PromptRenderer
from .service import EngineService
from .tool_calls import BadToolPiece, Piece, TextPiece, ToolCallStream, ToolPiece, tool_format_for


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """A protocol request after translation, before rendering."""

    conversation: Conversation
    identity: AgentIdentity
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    # The request's model field: only consulted when allow_model_swap_by_request is on.
    model: str | None = None


def renderer_for(service: EngineService) -> PromptRenderer:
    """One renderer per loaded model (a swap brings a new tokenizer)."""
    loaded = service.loaded
    cached = getattr(service, "_renderer", None)
    if cached is None or cached[0] is not loaded:
        cached = (loaded, PromptRenderer(loaded.tokenizer))
        service._renderer = cached  # type: ignore[attr-defined]
    return cached[1]


async def render_tokens(service: EngineService, conversation: Conversation) -> list[int]:
    renderer = renderer_for(service)
    return await service.in_thread(renderer.render, conversation)


async def prepare(service: EngineService, spec: TurnSpec) -> GenerationRequest:
    """Render and validate; raises PromptTooLongError and friends before any 200 is sent.

    Waits out a model swap first (or answers 503 after ``swap_wait_s``).
    """
    if spec.model and service.settings.allow_model_swap_by_request:
        await service.ensure_model(spec.model)
    await service.wait_ready()
    tokens = await render_tokens(service, spec.conversation)
    request = GenerationRequest(
        agent_id=spec.identity.agent_id,
        prompt_tokens=tuple(tokens),
        max_tokens=spec.max_tokens,
        sampling=spec.sampling,
        stop_strings=spec.stop,
        source=spec.identity.source,
        display_name=spec.identity.display_name,
        auxiliary=spec.identity.auxiliary,
        model_id=service.loaded.identity.key,
    )
    return service.engine.validate(request)


@dataclass(slots=True)
class OutputAssembler:
    """Engine text deltas in, text and tool-call pieces out (tool parsing only when tools were offered)."""

    tools: ToolCallStream | None
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def for_turn(cls, service: EngineService, conversation: Conversation, id_prefix: str) -> "OutputAssembler":
        if not conversation.tools or conversation.tool_choice == "none":
            return cls(None)
        schemas = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in conversation.tools]
        return cls(ToolCallStream(tool_format_for(service.loaded.tokenizer), schemas, id_prefix))

    def feed(self, delta: str) -> list[Piece]:
        pieces = self.tools.feed(delta) if self.tools else ([TextPiece(delta)] if delta else [])
        return self._note(pieces)

    def finish(self) -> list[Piece]:
        return self._note(self.tools.finish() if self.tools else [])

    def _note(self, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, BadToolPiece):
                piece = TextPiece(piece.text)
            if isinstance(piece, TextPiece):
                if not piece.text:
                    continue
                self.text += piece.text
            elif isinstance(piece, ToolPiece):
                self.calls.append(piece.call)
            out.append(piece)
        return out


def text_of(event: Any) -> str:
    return event.text if isinstance(event, TokenEvent) else ""


def ended_by(finish: FinishEvent, made_tool_calls: bool) -> str:
    """A protocol-neutral ending: stop, tool_use, stop_sequence, length, error, cancelled."""
    if finish.reason is FinishReason.ERROR:
        return "error"
    if finish.reason is FinishReason.CANCELLED:
        return "cancelled"
    if made_tool_calls:
        return "tool_use"
    if finish.reason is FinishReason.STOP_SEQUENCE:
        return "stop_sequence"
    if finish.reason in (FinishReason.LENGTH, FinishReason.CAPACITY):
        return "length"
    return "stop"


__all__ = [
    "AsyncTurn",
    "OutputAssembler",
    "TurnSpec",
    "ended_by",
    "prepare",
    "render_tokens",
    "renderer_for",
    "text_of",
]
