"""Server-sent events of a streamed text completion: chat completions' stream (``ChatStream``: replay, pings,
a failure after the 200 as one error frame, the close) with text completion chunks.

Frame order: the prompt's text first with ``echo``, text chunks as the model
writes them, a chunk with empty text carrying ``finish_reason``, with
``include_usage`` a chunk with ``"choices": []`` and the usage, then
``data: [DONE]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.domain.requests import EngineEvent, FinishEvent, TokenEvent

from .admission import failed, finish_error
from .completions_translate import chunk_body, usage_chunk_body
from .errors import error_body
from .openai_stream import DONE, ChatStream, frame


@dataclass(slots=True)
class TextStream(ChatStream):
    """One streamed text completion: engine events in, SSE frames out."""

    # The prompt's text, sent before the completion (``echo``); empty: nothing.
    echo: str = ""

    def _opening(self) -> list[str]:
        return [frame(chunk_body(self.writer.meta, self.echo))] if self.echo else []

    def _frames_for(self, event: EngineEvent) -> list[str]:
        if isinstance(event, FinishEvent):
            return self._ending(event)
        if not isinstance(event, TokenEvent):
            return []
        text = "".join(piece.text for piece in self.assembler.feed(event))
        return [frame(chunk_body(self.writer.meta, text))] if text else []

    def _ending(self, finish: FinishEvent) -> list[str]:
        if failed(finish):
            return [frame(error_body("openai", finish_error(finish))), DONE]
        frames = [frame(chunk_body(self.writer.meta, "", finish))]
        if self.include_usage:
            frames.append(frame(usage_chunk_body(self.writer.meta, finish)))
        return frames + [DONE]
