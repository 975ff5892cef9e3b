"""Server-sent events of a streamed chat completion.

Frame order: a role delta, content deltas and tool-call deltas as the text
is parsed, a chunk carrying ``finish_reason``, with ``include_usage`` a
chunk with ``"choices": []`` and the usage, then ``data: [DONE]``. A failure
after the 200 is one ``data: {"error": ...}`` frame (the OpenAI SDK raises
APIError on it) followed by ``[DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from engine.domain.requests import EngineEvent, FinishEvent, TokenEvent
from engine.formats.tools.calls import (
    Piece,
    ReasoningPiece,
    TextPiece,
    ToolArgumentsPiece,
    ToolPiece,
    ToolStartPiece,
)

from .admission import KEEP_ALIVE, failed, finish_error, replay
from .async_turn import AsyncTurn
from .errors import error_body, internal_error
from .openai_translate import CompletionMeta, finish_reason, tool_call_body, usage_body
from .turns import OutputAssembler

DONE = "data: [DONE]\n\n"


def frame(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(frozen=True, slots=True)
class ChunkWriter:
    meta: CompletionMeta

    def delta(self, delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return frame(self._envelope(choices=[choice]))

    def usage(self, finish: FinishEvent) -> str:
        return frame(self._envelope(choices=[], usage=usage_body(finish.usage)))

    def _envelope(self, **fields: Any) -> dict[str, Any]:
        meta = self.meta
        return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model, **fields}


@dataclass(slots=True)
class ChatStream:
    """One streamed completion: engine events in, SSE frames out."""

    turn: AsyncTurn
    seen: list[EngineEvent]
    assembler: OutputAssembler
    writer: ChunkWriter
    include_usage: bool
    ping_s: float
    # Called exactly once with the finish (None when the client went away first).
    on_end: Callable[[FinishEvent | None], None]
    tool_index: int = field(default=0)
    _ended: bool = field(default=False)

    async def frames(self) -> AsyncIterator[str]:
        try:
            for text in self._opening():
                yield text
            async for event in replay(self.seen, self.turn, self.ping_s):
                if event is None:
                    yield KEEP_ALIVE
                    continue
                for text in self._frames_for(event):
                    yield text
        except Exception as exc:  # after the 200, a bug can only be reported in the stream
            yield frame(error_body("openai", internal_error(exc, f"the stream of {self.turn.request_id}")))
            yield DONE
        finally:
            self.close()

    def close(self) -> None:
        """Stop generating for a client that went away; harmless after the finish.

        Runs from the generator's ``finally`` and again as the response's
        background task: a disconnect can leave the generator suspended at a
        ``yield``, where no cancellation reaches it until garbage collection.
        """
        if self._ended:
            return
        self._ended = True
        self.turn.cancel()
        self.on_end(self.turn.finish)

    def _opening(self) -> list[str]:
        return [self.writer.delta({"role": "assistant", "content": ""})]

    def _frames_for(self, event: EngineEvent) -> list[str]:
        if isinstance(event, TokenEvent):
            return self._pieces(self.assembler.feed(event))
        if isinstance(event, FinishEvent):
            return self._pieces(self.assembler.finish()) + self._ending(event)
        return []

    def _pieces(self, pieces: list[Piece]) -> list[str]:
        frames: list[str] = []
        for piece in pieces:
            if isinstance(piece, TextPiece):
                frames.append(self.writer.delta({"content": piece.text}))
            elif isinstance(piece, ReasoningPiece):
                frames.append(self.writer.delta({"reasoning_content": piece.text, "reasoning": piece.text}))
            elif isinstance(piece, ToolStartPiece):
                frames.append(self._tool_header(piece.id, piece.name))
            elif isinstance(piece, ToolArgumentsPiece):
                frames.append(self._tool_arguments(piece.text))
            elif isinstance(piece, ToolPiece) and piece.arguments_text is None:  # (one that streamed is sent)
                body = tool_call_body(piece.call)
                frames += [self._tool_header(piece.call.id, piece.call.name),
                           self._tool_arguments(body["function"]["arguments"])]
        return frames

    def _tool_header(self, call_id: str, name: str) -> str:
        """A call's first delta: its index, id and name (its arguments follow in deltas of their own)."""
        self.tool_index += 1
        return self.writer.delta({"tool_calls": [{"index": self.tool_index - 1, "id": call_id, "type": "function",
                                                  "function": {"name": name, "arguments": ""}}]})

    def _tool_arguments(self, text: str) -> str:
        return self.writer.delta({"tool_calls": [{"index": self.tool_index - 1, "function": {"arguments": text}}]})

    def _ending(self, finish: FinishEvent) -> list[str]:
        if failed(finish):
            return [frame(error_body("openai", finish_error(finish))), DONE]
        frames = [self.writer.delta({}, finish_reason(finish, self.assembler.calls))]
        if self.include_usage:
            frames.append(self.writer.usage(finish))
        return frames + [DONE]
