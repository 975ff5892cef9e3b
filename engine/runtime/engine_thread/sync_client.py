"""Drive an Engine synchronously: submit requests and collect their events.

For scripts, benchmarks and tests; servers use the event sink directly.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Iterator

from engine.runtime.engine_thread.engine import Engine
from engine.domain.requests import EngineEvent, FinishEvent, GenerationRequest, PrefillEvent, TokenEvent


@dataclass
class TurnResult:
    request: GenerationRequest
    events: list[EngineEvent] = field(default_factory=list)

    @property
    def finish(self) -> FinishEvent:
        last = self.events[-1]
        assert isinstance(last, FinishEvent), f"turn did not finish: {last}"
        return last

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEvent)]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenEvent))

    @property
    def reasoning(self) -> str:
        return "".join(e.reasoning for e in self.events if isinstance(e, TokenEvent))

    @property
    def prefill_events(self) -> list[PrefillEvent]:
        return [e for e in self.events if isinstance(e, PrefillEvent)]


def run_turns(engine: Engine, requests: list[GenerationRequest], timeout_s: float = 120.0) -> list[TurnResult]:
    """Submit all requests at once (so they share batches) and wait for every finish."""
    inboxes: list[queue.SimpleQueue[EngineEvent]] = []
    for request in requests:
        inbox: queue.SimpleQueue[EngineEvent] = queue.SimpleQueue()
        engine.submit(request, inbox.put)
        inboxes.append(inbox)
    return [_collect(request, inbox, timeout_s) for request, inbox in zip(requests, inboxes)]


def run_turn(engine: Engine, request: GenerationRequest, timeout_s: float = 120.0) -> TurnResult:
    return run_turns(engine, [request], timeout_s)[0]


def _collect(request: GenerationRequest, inbox: queue.SimpleQueue, timeout_s: float) -> TurnResult:
    result = TurnResult(request)
    while True:
        event = inbox.get(timeout=timeout_s)
        result.events.append(event)
        if isinstance(event, FinishEvent):
            return result


def stream_turn(engine: Engine, request: GenerationRequest, timeout_s: float = 120.0) -> Iterator[EngineEvent]:
    """Submit one request and yield its events as they arrive, ending with the FinishEvent."""
    inbox: queue.SimpleQueue[EngineEvent] = queue.SimpleQueue()
    engine.submit(request, inbox.put)
    while True:
        event = inbox.get(timeout=timeout_s)
        yield event
        if isinstance(event, FinishEvent):
            return
