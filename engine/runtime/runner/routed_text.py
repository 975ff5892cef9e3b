"""A turn's tokens as text, one stream per route: the answer, the reasoning, each call written on its own channel.

The routes come from the turn's reasoning tracker (``sequence.Released``);
markup never gets here. Each route has its own streaming detokenizer, so a
character split over two tokens of the reasoning is whole there, and the
answer's stop strings and turn ends (``text_stream.py``) are looked for in
the answer only: a stop string the model writes while it reasons does not
end the turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from engine.domain.reasoning import CallText, Channel, Route
from engine.runtime.runner.text_stream import StreamingDetokenizer, TextStream


@dataclass(slots=True)
class RoutedDelta:
    text: str = ""  # the answer's
    reasoning: str = ""
    calls: list[CallText] = field(default_factory=list)
    stop_sequence: str | None = None
    ends_turn: bool = False

    def add(self, route: Route, text: str, stop: str | None = None, ends_turn: bool = False) -> None:
        if route.channel is Channel.ANSWER:
            self.text += text
            self.stop_sequence = self.stop_sequence or stop
            self.ends_turn = self.ends_turn or ends_turn
        elif route.channel is Channel.REASONING:
            self.reasoning += text
        elif text:
            self.calls.append(CallText(route.call, route.name, text))

    @property
    def empty(self) -> bool:
        return not (self.text or self.reasoning or self.calls)


class RoutedText:
    def __init__(self, detokenizer: Callable[[], StreamingDetokenizer], stop_strings: tuple[str, ...] = (),
                 turn_ends: tuple[str, ...] = ()) -> None:
        self._detokenizer = detokenizer
        self.answer = TextStream(detokenizer(), stop_strings, turn_ends)
        self._streams: dict[Route, TextStream] = {}
        self.reasoning = ""  # everything the reasoning said so far

    @property
    def text(self) -> str:
        return self.answer.text

    def push(self, released: Iterable[tuple[int, Route]]) -> RoutedDelta:
        delta = RoutedDelta()
        for token, route in released:
            part = self._stream(route).push(token)
            delta.add(route, part.text, part.stop_sequence, part.ends_turn)
        self.reasoning += delta.reasoning
        return delta

    def finish(self) -> RoutedDelta:
        """Flush every stream (the end of the turn)."""
        delta = RoutedDelta()
        for route, stream in [(Route(Channel.ANSWER), self.answer), *self._streams.items()]:
            part = stream.finish()
            delta.add(route, part.text, part.stop_sequence, part.ends_turn)
        self.reasoning += delta.reasoning
        return delta

    def _stream(self, route: Route) -> TextStream:
        if route.channel is Channel.ANSWER:
            return self.answer
        stream = self._streams.get(route)
        if stream is None:
            stream = self._streams[route] = TextStream(self._detokenizer())
        return stream
