"""Engine events for the chat panes, batched, and the words the panes show for them.

No widgets here: the pane awaits one batch at a time, so however fast the
engine produces tokens the UI does one update per batch, never one per token.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from rich.text import Text

from engine.api.async_turn import AsyncTurn
from engine.domain.requests import (
    EngineEvent,
    EventSink,
    FinishEvent,
    FinishReason,
    PrefillEvent,
    QueuedEvent,
    TokenEvent,
    Usage,
)

# Endings after which the reply is a real assistant message worth keeping in the history.
NORMAL_ENDINGS = frozenset({FinishReason.STOP, FinishReason.COMPLETE, FinishReason.STOP_SEQUENCE,
                            FinishReason.TURN_END, FinishReason.LENGTH, FinishReason.TIME_LIMIT,
                            FinishReason.FORMAT_CUT})


class PaneState(str, enum.Enum):
    """What a pane's header says its agent is doing."""

    IDLE = "idle"
    PREPARING = "rendering prompt"
    QUEUED = "queued"
    PREFILLING = "prefilling"
    THINKING = "thinking"  # a thinking model's reasoning streams
    GENERATING = "generating"
    STOPPING = "stopping"
    WATCHING = "watching"


STATE_STYLES = {
    PaneState.IDLE: "dim",
    PaneState.WATCHING: "dim",
    PaneState.QUEUED: "magenta",
    PaneState.PREFILLING: "cyan",
    PaneState.THINKING: "blue",
    PaneState.GENERATING: "green",
    PaneState.STOPPING: "yellow",
}

SOURCE_NAMES = {
    "tui": "workbench",
    "claude-code": "Claude Code",
    "codex": "Codex CLI",
    "anthropic": "an Anthropic client",
    "openai": "an OpenAI client",
    "api": "the HTTP API",
    "bench": "the benchmark",
}

# At most this many screen updates a second per pane: a faster model only makes the batches bigger.
UPDATES_PER_S = 12.0
# Watching another client's agent: re-rendering streamed Markdown is the UI's
# most expensive work and competes with the engine for the CPU, so it is
# updated less often than a chat the user types in.
WATCH_UPDATES_PER_S = 4.0


class EventFeed:
    """An asyncio queue of engine events that hands them out in batches, at most ``max_rate`` a second."""

    def __init__(self, max_rate: float = UPDATES_PER_S) -> None:
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._interval_s = 1.0 / max_rate
        self._last_batch_at = float("-inf")

    def put(self, event: EngineEvent) -> None:
        self._queue.put_nowait(event)

    def threadsafe_sink(self, loop: asyncio.AbstractEventLoop) -> EventSink:
        """A sink the engine thread may call: it only schedules a put on ``loop``."""

        def sink(event: EngineEvent) -> None:
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, event)
            except RuntimeError:
                # The app closed its loop while the engine still reported; nobody is listening.
                pass

        return sink

    async def next_batch(self) -> list[EngineEvent]:
        """Wait for one event, let more gather if the last batch was recent, then take them all.

        The first event after a quiet spell comes out at once, so the time to
        first token on screen is the engine's, not the rate limit's.
        """
        events = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        early_by = self._last_batch_at + self._interval_s - loop.time()
        if early_by > 0:
            await asyncio.sleep(early_by)
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        self._last_batch_at = loop.time()
        return events


async def pump(turn: AsyncTurn, feed: EventFeed) -> None:
    """Move a turn's events into ``feed``; AsyncTurn hands them out one by one."""
    async for event in turn.events():
        if event is not None:
            feed.put(event)


@dataclass(slots=True)
class TurnBatch:
    """What one batch of events of one request changes on screen."""

    request_id: str
    text: str = ""
    reasoning: str = ""
    reasoning_tokens: int = 0  # tokens that carried reasoning (the usage has the exact count at the end)
    queued: QueuedEvent | None = None
    prefill: PrefillEvent | None = None
    finish: FinishEvent | None = None


def split_batch(events: list[EngineEvent]) -> list[TurnBatch]:
    """Fold a batch into one summary per request (a watched agent may start its next turn mid-batch)."""
    batches: list[TurnBatch] = []
    for event in events:
        if not batches or batches[-1].request_id != event.request_id:
            batches.append(TurnBatch(event.request_id))
        _fold(batches[-1], event)
    return batches


def _fold(batch: TurnBatch, event: EngineEvent) -> None:
    if isinstance(event, TokenEvent):
        batch.text += event.text
        if event.reasoning:
            batch.reasoning += event.reasoning
            batch.reasoning_tokens += 1
    elif isinstance(event, PrefillEvent):
        batch.prefill = event
    elif isinstance(event, QueuedEvent):
        batch.queued = event
    elif isinstance(event, FinishEvent):
        batch.finish = event


def usage_line(usage: Usage) -> str:
    """"reused 1,234 · prefilled 56 · generated 78 · TTFT 0.42 s · 19.3 tok/s · shared from x"."""
    parts = [
        f"reused {usage.reused_tokens:,}",
        f"prefilled {usage.prefilled_tokens:,}",
        f"generated {usage.generated_tokens:,}",
    ]
    if usage.reasoning_tokens:
        parts.append(f"thinking {usage.reasoning_tokens:,}")
    if usage.ttft_s is not None:
        parts.append(f"TTFT {usage.ttft_s:.2f} s")
    if usage.decode_tok_s:
        parts.append(f"{usage.decode_tok_s:.1f} tok/s")
    origin = reuse_origin(usage.reuse_source)
    if origin:
        parts.append(origin)
    if usage.reuse_note:
        parts.append(usage.reuse_note)
    return " · ".join(parts)


def reuse_origin(source: str) -> str:
    """Only borrowed or restored caches are worth a word; an agent's own cache is the default."""
    if source.startswith("shared:"):
        return f"shared from {source.split(':', 1)[1]}"
    if source in ("warm", "disk"):
        return "restored from disk"
    return ""


def request_line(prefill: PrefillEvent) -> str:
    prompt = prefill.total + prefill.reused
    return f"⟵ request: {prompt:,} prompt tokens, {prefill.reused:,} reused"


def read_only_hint(source: str) -> str:
    return f"read-only: driven by {SOURCE_NAMES.get(source, source)}"


def ending_text(finish: FinishEvent) -> str | None:
    """The inline note for a turn that did not end normally (None when it did)."""
    if finish.reason is FinishReason.ERROR:
        return f"error: {finish.error or 'the engine failed this turn'}"
    if finish.reason is FinishReason.CANCELLED:
        return "stopped"
    if finish.reason is FinishReason.CAPACITY:
        return "stopped: the KV pool is full (capacity)"
    return None


def header_text(
    label: str, source: str, state: PaneState, prefill: tuple[int, int], batch_size: int
) -> Text:
    """"label · state · source"; the state comes first so a narrow pane's ellipsis eats the source."""
    header = Text(no_wrap=True, overflow="ellipsis")
    header.append(label, style="bold")
    header.append(" · ")
    header.append(state_text(state, prefill, batch_size), style=STATE_STYLES.get(state, ""))
    header.append(f" · {source}", style="dim")
    return header


def state_text(state: PaneState, prefill: tuple[int, int], batch_size: int) -> str:
    if state is PaneState.PREFILLING:
        done, total = prefill
        return f"prefilling {done:,}/{total:,}"
    if state is PaneState.GENERATING and batch_size > 1:
        # The engine decodes every running turn in one batch: say how many share it.
        return f"generating · batch {batch_size}"
    return state.value
