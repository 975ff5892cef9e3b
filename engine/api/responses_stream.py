"""Server-sent events of a streamed Responses API turn.

Event order, each with an ``event:`` line naming its type and a
``sequence_number`` counting from 0:

``response.created``, ``response.in_progress``; then per output item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, for a function call
``response.function_call_arguments.delta`` and ``.done``, for a thinking
model's reasoning ``response.reasoning_text.delta``... and ``.done``; then
``response.output_item.done`` (a reasoning item's carries its
``encrypted_content`` when the request's ``include`` asked for it); at the end
``response.completed`` (or ``response.incomplete`` when max_output_tokens
ended it).

A failure after the 200 is ``response.failed`` with the error in the
response object (Codex reads ``error.code``: ``context_length_exceeded`` makes
it report a full context instead of retrying) and, when an exception ended
the stream, an ``error`` event first. Text after a tool call opens a new
message item, so the items keep the order the model wrote them in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from engine.domain.chat import ToolCall
from engine.domain.requests import EngineEvent, FinishEvent, TokenEvent
from engine.errors import SemanticError
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
from .errors import ApiError, from_domain, internal_error
from .reasoning_signature import sign
from .responses_items import Item, function_call_item, message_item, new_id
from .responses_translate import ResponseMeta, outcome
from .turns import OutputAssembler


def sse(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_object(error: ApiError) -> dict[str, Any]:
    code = error.code or ("rate_limit_exceeded" if error.status == 429 else
                          "server_error" if error.status >= 500 else "invalid_request")
    return {"code": code, "message": error.message}


@dataclass(slots=True)
class EventWriter:
    """Numbers the events of one response."""

    meta: ResponseMeta
    sequence: int = 0

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(payload)

    def opening(self) -> list[str]:
        state = self.meta.body("in_progress", [])
        return [self.event("response.created", response=state), self.event("response.in_progress", response=state)]

    def failure(self, error: ApiError, output: list[Item]) -> str:
        return self.event("response.failed", response=self.meta.body("failed", output, error=error_object(error)))


def failed_before_start(meta: ResponseMeta, error: ApiError) -> AsyncIterator[str]:
    """A stream that fails at once: what a streaming client gets for a prompt too long for the context."""
    writer = EventWriter(meta)

    async def frames() -> AsyncIterator[str]:
        for frame in writer.opening():
            yield frame
        yield writer.failure(error, [])
    return frames()


@dataclass(slots=True)
class ResponseStream:
    """One streamed response: engine events in, typed SSE events out."""

    turn: AsyncTurn
    seen: list[EngineEvent]
    assembler: OutputAssembler
    writer: EventWriter
    ping_s: float
    # Stores the finished response (worker thread); runs before the closing event goes out,
    # so a client that continues the moment it reads response.completed finds it stored.
    settle: Callable[[dict[str, Any], list[Item]], Awaitable[None]]
    # Called exactly once with the finish (None when the client went away first).
    on_end: Callable[[FinishEvent | None], None]
    output: list[Item] = field(default_factory=list)
    _message: Item | None = None
    _reasoning: Item | None = None
    _ended: bool = False

    async def frames(self) -> AsyncIterator[str]:
        try:
            for frame in self.writer.opening():
                yield frame
            async for event in replay(self.seen, self.turn, self.ping_s):
                if event is None:
                    yield KEEP_ALIVE
                elif isinstance(event, TokenEvent):
                    for frame in self._pieces(self.assembler.feed(event)):
                        yield frame
                elif isinstance(event, FinishEvent):
                    for frame in self._pieces(self.assembler.finish()):
                        yield frame
                    async for frame in self._ending(event):
                        yield frame
        except Exception as exc:  # after the 200, a bug can only be reported in the stream
            error = internal_error(exc, f"the stream of {self.turn.request_id}")
            yield self.writer.event("error", code="server_error", message=error.message, param=None)
            yield self.writer.failure(error, self.output)
        finally:
            self.close()

    def close(self) -> None:
        """Stop generating for a client that went away; harmless after the finish (see ChatStream.close)."""
        if self._ended:
            return
        self._ended = True
        self.turn.cancel()
        self.on_end(self.turn.finish)

    # -- items ------------------------------------------------------------------------------------
    def _pieces(self, pieces: list[Piece]) -> list[str]:
        frames: list[str] = []
        for piece in pieces:
            if isinstance(piece, ReasoningPiece):
                frames.extend(self._close_message())
                frames.extend(self._reasoning_text(piece.text))
                continue
            frames.extend(self._close_reasoning())
            if isinstance(piece, TextPiece):
                frames.extend(self._text(piece.text))
            elif isinstance(piece, ToolStartPiece):
                frames.extend(self._close_message())
                frames.extend(self._function_call_start(piece))
            elif isinstance(piece, ToolArgumentsPiece):
                frames.extend(self._function_call_arguments(piece.text))
            elif isinstance(piece, ToolPiece):
                frames.extend(self._close_message())
                frames.extend(self._function_call(piece))
        return frames

    def _reasoning_text(self, text: str) -> list[str]:
        frames: list[str] = []
        if self._reasoning is None:
            self._reasoning = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                               "content": []}
            self.output.append(self._reasoning)
            frames.append(self.writer.event("response.output_item.added", output_index=len(self.output) - 1,
                                            item=dict(self._reasoning)))
            self._reasoning["content"] = [{"type": "reasoning_text", "text": ""}]
        self._reasoning["content"][0]["text"] += text
        frames.append(self.writer.event("response.reasoning_text.delta", item_id=self._reasoning["id"],
                                        output_index=len(self.output) - 1, content_index=0, delta=text))
        return frames

    def _close_reasoning(self) -> list[str]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        text = item["content"][0]["text"]
        index = next(i for i, out in enumerate(self.output) if out is item)
        item["status"] = "completed"
        if self.writer.meta.request.includes_encrypted_reasoning:
            item["encrypted_content"] = sign(text)
        return [self.writer.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text),
                self.writer.event("response.output_item.done", output_index=index, item=item)]

    def _text(self, text: str) -> list[str]:
        frames: list[str] = []
        if self._message is None:
            self._message = message_item(new_id("msg"), "", "in_progress")
            self.output.append(self._message)
            frames.append(self.writer.event("response.output_item.added", output_index=len(self.output) - 1,
                                            item=self._message))
            frames.append(self.writer.event("response.content_part.added", **self._where(),
                                            part={"type": "output_text", "text": "", "annotations": []}))
            self._message["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
        if text:
            self._message["content"][0]["text"] += text
            frames.append(self.writer.event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        return frames

    def _close_message(self, status: str = "completed") -> list[str]:
        message, self._message = self._message, None
        if message is None:
            return []
        part = message["content"][0]
        message["status"] = status
        index = next(i for i, item in enumerate(self.output) if item is message)  # by identity, not by value
        where = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [self.writer.event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self.writer.event("response.content_part.done", **where,
                                  part={"type": "output_text", "text": part["text"], "annotations": []}),
                self.writer.event("response.output_item.done", output_index=index, item=message)]

    def _where(self) -> dict[str, Any]:
        assert self._message is not None
        return {"item_id": self._message["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _function_call_start(self, start: ToolStartPiece) -> list[str]:
        """A call that streams: its item now, in progress; its arguments in deltas as they are written."""
        item = function_call_item(new_id("fc"), ToolCall(start.id, start.name, {}), "in_progress") | {"arguments": ""}
        self.output.append(item)
        return [self.writer.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _function_call_arguments(self, text: str) -> list[str]:
        item = self.output[-1]
        item["arguments"] += text
        return [self.writer.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=len(self.output) - 1, delta=text)]

    def _function_call(self, piece: ToolPiece) -> list[str]:
        frames: list[str] = []
        last = self.output[-1] if self.output else None
        if piece.arguments_text is not None and last is not None and last.get("call_id") == piece.call.id:
            item, index = last, len(self.output) - 1  # it streamed: its item ends here, its arguments as sent
            item["status"] = "completed" if piece.complete else "incomplete"
        else:
            item = function_call_item(new_id("fc"), piece.call)
            self.output.append(item)
            index = len(self.output) - 1
            frames += [
                self.writer.event("response.output_item.added", output_index=index,
                                  item={**item, "arguments": "", "status": "in_progress"}),
                self.writer.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=item["arguments"]),
            ]
        return frames + [
            self.writer.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=item["arguments"]),
            self.writer.event("response.output_item.done", output_index=index, item=item),
        ]

    async def _ending(self, finish: FinishEvent) -> AsyncIterator[str]:
        for frame in self._close_reasoning():
            yield frame
        if failed(finish):
            for frame in self._close_message("incomplete"):
                yield frame
            yield self.writer.failure(finish_error(finish), self.output)
            return
        status, reason = outcome(finish, bool(self.assembler.calls))
        # An empty reply is still one (empty) message, also when the model only reasoned.
        frames = self._text("") if not any(item["type"] != "reasoning" for item in self.output) else []
        for frame in frames + self._close_message("incomplete" if status == "incomplete" else "completed"):
            yield frame
        body = self.writer.meta.body(status, self.output, finish.usage, reason)
        try:
            await self.settle(body, self.output)
        except SemanticError as exc:
            yield self.writer.failure(from_domain(exc), self.output)
            return
        yield self.writer.event("response.completed" if status == "completed" else "response.incomplete",
                                response=body)
