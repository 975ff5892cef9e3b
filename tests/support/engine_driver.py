"""Drive an Engine synchronously from a test: submit requests, collect their events."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from mlx_lm.generate import generate_step, generation_stream

from engine.runtime.engine import Engine
from engine.runtime.requests import EngineEvent, FinishEvent, GenerationRequest, PrefillEvent, TokenEvent


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


def reference_greedy(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """Single-stream mlx-lm greedy tokens, stopping after an EOS token like the engine does."""
    import mlx.core as mx

    out: list[int] = []
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    for (token, _), _ in zip(steps, range(max_tokens)):
        token = int(token)
        out.append(token)
        if token in eos:
            break
    steps.close()
    # generate_step leaves the next token in flight on mlx-lm's stream; an
    # unfinished stream task at interpreter exit aborts the process.
    mx.synchronize(generation_stream)
    return out
