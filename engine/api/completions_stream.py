"""Server-sent events of a streamed text completion.

Frame order: the prompt's text first with ``echo``, text chunks as the model
writes them, a chunk with empty text carrying ``finish_reason``, with
``include_usage`` a chunk with ``"choices": []`` and the usage, then
``data: [DONE]``. A failure after the 200 is one ``data: {"error": ...}``
frame followed by ``[DONE]`` (the OpenAI SDK raises APIError on it), as on
chat completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from engine.domain.requests import EngineEvent, FinishEvent

from .admission import KEEP_ALIVE, failed, finish_error, replay
from .async_turn import AsyncTurn
from .completions_translate import chunk_body, usage_chunk_body
from .errors import error_body, internal_error
from .openai_stream import DONE, frame
from .openai_translate import CompletionMeta
from .turns import OutputAssembler


@dataclass(slots=True)
class TextStream:
    """One streamed completion: engine events in, SSE frames out."""

    turn: AsyncTurn
    seen: list[EngineEvent]
    assembler: OutputAssembler
    meta: CompletionMeta
    echo: str
    include_usage: bool
    ping_s: float
    # Called exactly once with the finish (None when the client went away first).
    on_end: Callable[[FinishEvent | None], None]
    _ended: bool = field(default=False)

    async def frames(self) -> AsyncIterator[str]:
        try:
            if self.echo:
                yield frame(chunk_body(self.meta, self.echo))
            async for event in replay(self.seen, self.turn, self.ping_s):
                if event is None:
                    yield KEEP_ALIVE
                elif isinstance(event, FinishEvent):
                    for text in self._ending(event):
                        yield text
                else:
                    text = "".join(piece.text for piece in self.assembler.feed(event))
                    if text:
                        yield frame(chunk_body(self.meta, text))
        except Exception as exc:  # after the 200, a bug can only be reported in the stream
            yield frame(error_body("openai", internal_error(exc, f"the stream of {self.turn.request_id}")))
            yield DONE
        finally:
            self.close()

    def close(self) -> None:
        """Stop generating for a client that went away; harmless after the finish (runs from the generator's
        ``finally`` and as the response's background task, as ChatStream.close does)."""
        if self._ended:
            return
        self._ended = True
        self.turn.cancel()
        self.on_end(self.turn.finish)

    def _ending(self, finish: FinishEvent) -> list[str]:
        if failed(finish):
            return [frame(error_body("openai", finish_error(finish))), DONE]
        frames = [frame(chunk_body(self.meta, "", finish))]
        if self.include_usage:
            frames.append(frame(usage_chunk_body(self.meta, finish)))
        return frames + [DONE]
