"""Engine events to Anthropic Messages responses: content blocks, usage, SSE frames.

One ``ContentBlocks`` state machine serves both response kinds: it turns text
and tool-call pieces into ``content_block_*`` payloads (streamed as they come)
and keeps the final ``content`` list (the non-streaming body), so the two can
never disagree on block order or indices.

A stream is ``message_start`` -> per block ``content_block_start`` /
``content_block_delta``... / ``content_block_stop`` -> ``message_delta`` ->
``message_stop``, with ``ping`` whenever ``ping_s`` passed without a frame
(a long prefill sends nothing else, and Claude Code gives up on a silent
stream). ``message_start`` waits for the engine's PrefillEvent, which carries
how many prompt tokens were reused, so its usage split is exact.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.domain.chat import ToolCall
from engine.domain.requests import (
    EngineEvent,
    FinishEvent,
    PrefillEvent,
    QueuedEvent,
    TokenEvent,
)
from engine.formats.tools.calls import (
    Piece,
    ReasoningPiece,
    TextPiece,
    ToolArgumentsPiece,
    ToolPiece,
    ToolStartPiece,
)

from .admission import failed, finish_error
from .async_turn import AsyncTurn
from .errors import ApiError, internal_error, stream_error_payload
from .reasoning_signature import sign
from .retention import usage_split
from .turns import OutputAssembler, ended_by

STOP_REASONS = {"stop": "end_turn", "tool_use": "tool_use", "stop_sequence": "stop_sequence", "length": "max_tokens"}
JSON_CHUNKS = 3
PING = {"type": "ping"}

Payload = dict[str, Any]
Recorder = Callable[[FinishEvent | None, str | None], None]


# -- content blocks ----------------------------------------------------------------------------
@dataclass(slots=True)
class ContentBlocks:
    """Pieces in, ``content_block_*`` payloads out; ``content`` is the final list.

    Whitespace before any text (a model's leading newline, the gap between two
    tool calls) is held back until real text follows, so no block is blank.
    Reasoning is a ``thinking`` block, closed by a ``signature_delta`` whose
    signature carries the reasoning (reasoning_signature.py); with ``omitted``
    (the request's ``display: "omitted"``) its text is withheld, the signature
    still carries it. A tool call that streams opens its ``tool_use`` block at
    its start and sends each part of its arguments as an ``input_json_delta``
    as the model writes it; the block's ``input`` is those parts joined, parsed.
    """

    omitted: bool = False
    content: list[Payload] = field(default_factory=list)
    _open: str | None = None  # the type of the block open now: "text", "thinking", "tool_use" or None
    _held: str = ""
    _reasoning: str = ""

    def add(self, pieces: list[Piece]) -> list[Payload]:
        out: list[Payload] = []
        for piece in pieces:
            if isinstance(piece, TextPiece):
                out += self._text(piece.text)
            elif isinstance(piece, ReasoningPiece):
                out += self._thinking(piece.text)
            elif isinstance(piece, ToolStartPiece):
                out += self._tool_start(piece)
            elif isinstance(piece, ToolArgumentsPiece):
                out.append(_block_delta(len(self.content) - 1,
                                        {"type": "input_json_delta", "partial_json": piece.text}))
            elif isinstance(piece, ToolPiece):
                out += self._tool(piece.call)
        return out

    def close(self) -> list[Payload]:
        self._held = ""
        kind, self._open = self._open, None
        if kind is None:
            return []
        index = len(self.content) - 1
        out: list[Payload] = []
        if kind == "thinking":
            signature = sign(self._reasoning)
            self.content[index]["signature"] = signature
            out.append(_block_delta(index, {"type": "signature_delta", "signature": signature}))
        return out + [{"type": "content_block_stop", "index": index}]

    def _text(self, text: str) -> list[Payload]:
        out: list[Payload] = []
        if self._open != "text":
            text, self._held = self._held + text, ""
            if not text.strip():
                self._held = text
                return []
            out += self.close()
            self.content.append({"type": "text", "text": ""})
            self._open = "text"
            out.append(_block_start(len(self.content) - 1, {"type": "text", "text": ""}))
        self.content[-1]["text"] += text
        out.append(_block_delta(len(self.content) - 1, {"type": "text_delta", "text": text}))
        return out

    def _thinking(self, text: str) -> list[Payload]:
        out: list[Payload] = []
        if self._open != "thinking":
            out += self.close()
            self.content.append({"type": "thinking", "thinking": "", "signature": ""})
            self._open, self._reasoning = "thinking", ""
            out.append(_block_start(len(self.content) - 1, {"type": "thinking", "thinking": "", "signature": ""}))
        self._reasoning += text
        if not self.omitted:
            self.content[-1]["thinking"] += text
            out.append(_block_delta(len(self.content) - 1, {"type": "thinking_delta", "thinking": text}))
        return out

    def _tool_start(self, start: ToolStartPiece) -> list[Payload]:
        out = self.close()
        self.content.append({"type": "tool_use", "id": start.id, "name": start.name, "input": {}})
        self._open = "tool_use"
        return out + [_block_start(len(self.content) - 1, {"type": "tool_use", "id": start.id, "name": start.name,
                                                             "input": {}})]

    def _tool(self, call: ToolCall) -> list[Payload]:
        if self._open == "tool_use" and self.content[-1]["id"] == call.id:  # it streamed: its block ends here
            self.content[-1]["input"] = call.arguments
            self._open = None
            return [{"type": "content_block_stop", "index": len(self.content) - 1}]
        out = self.close()
        index = len(self.content)
        self.content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
        out.append(_block_start(index, {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}))
        for chunk in json_chunks(call.arguments):
            out.append(_block_delta(index, {"type": "input_json_delta", "partial_json": chunk}))
        out.append({"type": "content_block_stop", "index": index})
        return out


def json_chunks(value: dict[str, Any]) -> list[str]:
    """The input's JSON in a few fragments, as a model would stream it."""
    text = json.dumps(value, ensure_ascii=False)
    size = max(8, math.ceil(len(text) / JSON_CHUNKS))
    return [text[at:at + size] for at in range(0, len(text), size)]


def _block_start(index: int, block: Payload) -> Payload:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _block_delta(index: int, delta: Payload) -> Payload:
    return {"type": "content_block_delta", "index": index, "delta": delta}


# -- message parts ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MessageHead:
    id: str
    model: str
    prompt_tokens: int
    # Prompt tokens before the request's last cache_control breakpoint (retention.py); 0: none.
    retain_tokens: int = 0
    # Cache diagnostics (cache_diagnostics.py): sent only when the request asked, null when nothing diverged.
    diagnosed: bool = False
    diagnostics: Payload | None = None
    # The request's thinking.display was "omitted": thinking blocks carry their reasoning in the signature only.
    omit_thinking: bool = False

    def extra(self) -> Payload:
        return {"diagnostics": self.diagnostics} if self.diagnosed else {}


def usage_body(prompt_tokens: int, reused: int, generated: int, retain_tokens: int = 0) -> Payload:
    """Anthropic's split: input_tokens + cache_creation_input_tokens + cache_read_input_tokens == the
    prompt; creation is what was prefilled before the last cache_control breakpoint (retention.py)."""
    fresh, created, read = usage_split(prompt_tokens, reused, retain_tokens)
    return {"input_tokens": fresh, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read, "output_tokens": generated}


def final_usage(finish: FinishEvent, head: MessageHead) -> Payload:
    usage = finish.usage
    return usage_body(usage.prompt_tokens, usage.reused_tokens, usage.generated_tokens, head.retain_tokens)


def stop_of(finish: FinishEvent, made_tool_calls: bool) -> tuple[str, str | None]:
    reason = STOP_REASONS[ended_by(finish, made_tool_calls)]
    return reason, finish.stop_sequence if reason == "stop_sequence" else None


def error_if_failed(finish: FinishEvent) -> ApiError | None:
    """The error a failed or server-cancelled generation answers with; None when it ended normally."""
    return finish_error(finish) if failed(finish) else None


def message_body(head: MessageHead, content: list[Payload], finish: FinishEvent, made_tool_calls: bool) -> Payload:
    stop_reason, stop_sequence = stop_of(finish, made_tool_calls)
    return {"id": head.id, "type": "message", "role": "assistant", "model": head.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": final_usage(finish, head),
            **head.extra()}


def message_start(head: MessageHead, reused: int) -> Payload:
    message = {"id": head.id, "type": "message", "role": "assistant", "model": head.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": usage_body(head.prompt_tokens, reused, 0, head.retain_tokens), **head.extra()}
    return {"type": "message_start", "message": message}


def sse_frame(payload: Payload) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


# -- streaming -----------------------------------------------------------------------------------
async def first_event(turn: AsyncTurn, within_s: float) -> EngineEvent | None:
    """The first event past the queue (admission, or an error such as no pool room), if it comes in time."""
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        event = await turn.next_event(left)
        if not isinstance(event, QueuedEvent):
            return event
    return None


class MessageStream:
    """The frames of one streamed turn; ``close`` cancels the generation if it is still running."""

    def __init__(self, turn: AsyncTurn, assembler: OutputAssembler, head: MessageHead,
                 ping_s: float, record: Recorder) -> None:
        self.turn = turn
        self.assembler = assembler
        self.head = head
        self.ping_s = ping_s
        self.record = record
        self.blocks = ContentBlocks(head.omit_thinking)
        self.started = False
        self.closed = False
        self._last_sent = time.monotonic()

    async def frames(self, opening: EngineEvent | None = None) -> AsyncIterator[bytes]:
        try:
            async for payload in self._payloads(opening):
                self._last_sent = time.monotonic()
                yield sse_frame(payload)
        except Exception as exc:  # after the 200, a bug can only be reported in the stream
            yield sse_frame(stream_error_payload(internal_error(exc, f"the stream of {self.turn.request_id}")))
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.turn.cancel()
        finish = self.turn.finish
        self.record(finish, None if finish is not None else "cancelled")

    async def _payloads(self, opening: EngineEvent | None) -> AsyncIterator[Payload]:
        async for event in self._events(opening):
            if event is None:
                yield PING
            elif isinstance(event, FinishEvent):
                for payload in self._ending(event):
                    yield payload
            elif isinstance(event, (PrefillEvent, TokenEvent)):
                for payload in self._progress(event):
                    yield payload

    async def _events(self, opening: EngineEvent | None) -> AsyncIterator[EngineEvent | None]:
        """Engine events, and None whenever ``ping_s`` passed since the last frame."""
        if opening is not None:
            yield opening
        while self.turn.finish is None:
            wait = self.ping_s - (time.monotonic() - self._last_sent)
            yield await self.turn.next_event(wait) if wait > 0 else None

    def _progress(self, event: PrefillEvent | TokenEvent) -> list[Payload]:
        out = self._start(event.reused if isinstance(event, PrefillEvent) else 0)
        if isinstance(event, TokenEvent):
            out += self.blocks.add(self.assembler.feed(event))
        return out

    def _start(self, reused: int) -> list[Payload]:
        if self.started:
            return []
        self.started = True
        return [message_start(self.head, reused)]

    def _ending(self, finish: FinishEvent) -> list[Payload]:
        error = error_if_failed(finish)
        if error is not None:
            return [stream_error_payload(error)]
        out = self._start(finish.usage.reused_tokens)
        out += self.blocks.add(self.assembler.finish()) + self.blocks.close()
        stop_reason, stop_sequence = stop_of(finish, bool(self.assembler.calls))
        out.append({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": final_usage(finish, self.head)})
        out.append({"type": "message_stop"})
        return out


class SseResponse(StreamingResponse):
    """An event stream that always runs ``on_close`` however the response ends.

    Starlette stops iterating when the client goes away but does not close the
    generator; ``on_close`` is what cancels the generation then.
    """

    def __init__(self, frames: AsyncIterator[bytes], on_close: Callable[[], None],
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(frames, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
