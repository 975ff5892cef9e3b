"""The live stream's publisher: one stats snapshot per tick for every client, and the event log as it grows.

Building a snapshot costs the same for one client as for fifty, so one task
builds each frame once and hands the same bytes to every client due for it.
Clients are due on a grid (multiples of their interval), so fifty clients at
0.5 s share one build every half second rather than spreading fifty across it.

Nothing here waits for a client: each one has a bounded buffer (the newest
unsent stats frame, which a newer one replaces, and up to ``log_bound`` log
frames, the oldest dropped first), and what was dropped is counted and told
to the client in its next write. A client that stops reading blocks only its
own writer, in uvicorn's flow control, never this publisher or the engine.

Reading the engine costs no waiting on its thread: ``build_stats`` reads the
snapshot the engine last published, and the event log's lock is held only
for a copy of the events after a sequence number.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import deque
from dataclasses import dataclass, field

from engine.domain.event_log import EventLog, LogEvent
from engine.errors import EngineUnavailableError

from .admin_routes import build_stats
from .errors import ApiError
from .service import EngineService

log = logging.getLogger("semantic.api")

# How often new events are looked for: the delay a log frame can have, and the publisher's tick.
LOG_POLL_S = 0.05
# Log frames one client may have unsent before the oldest are dropped (twice the engine's ring by default:
# a resume that asks for the whole ring fits).
LOG_BOUND = 4000
CAP_RETRY_AFTER_S = 5


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """What one client asked for."""

    interval_s: float
    blocks: bool
    # Resume: send the events after this sequence number that the ring still holds; None: only new ones.
    after: int | None = None


@dataclass(frozen=True, slots=True)
class LogFrame:
    seq: int
    data: bytes


@dataclass(slots=True)
class Drops:
    """Frames a client lost since it was last told: stats replaced unsent, log events dropped or gone from
    the ring, with the first and last lost sequence numbers (a client may resume after first - 1)."""

    stats: int = 0
    log: int = 0
    first_seq: int | None = None
    last_seq: int | None = None

    def lost_events(self, first: int, last: int) -> None:
        self.log += last - first + 1
        self.first_seq = first if self.first_seq is None else min(self.first_seq, first)
        self.last_seq = last if self.last_seq is None else max(self.last_seq, last)

    def __bool__(self) -> bool:
        return bool(self.stats or self.log)


@dataclass(slots=True)
class StreamTotals:
    """Since the server started, for /metrics."""

    stats_built: int = 0
    stats_dropped: int = 0
    log_dropped: int = 0
    refused: int = 0


def sse(name: str, data: object, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def log_frame(event: LogEvent) -> LogFrame:
    body = {"seq": event.seq, "at": event.at, "kind": event.kind.value, "message": event.message,
            "agent_id": event.agent_id, "level": event.level}
    return LogFrame(event.seq, sse("log", body, event.seq))


def dropped_frame(drops: Drops) -> bytes:
    missed = {"first": drops.first_seq, "last": drops.last_seq} if drops.log else None
    return sse("dropped", {"stats": drops.stats, "log": drops.log, "log_missed": missed})


def next_tick(now: float, interval_s: float) -> float:
    """The next multiple of the interval: clients with the same interval fall due together."""
    return (math.floor(now / interval_s) + 1) * interval_s


@dataclass(eq=False, slots=True)
class Subscriber:
    """One client's bounded buffer, filled by the publisher and emptied by the client's writer."""

    options: StreamOptions
    log_bound: int
    due_at: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    drops: Drops = field(default_factory=Drops)
    _stats: bytes | None = None
    _log: deque[LogFrame] = field(default_factory=deque)

    def offer_stats(self, frame: bytes) -> bool:
        """Replace any unsent stats frame; True when one was dropped so."""
        replaced = self._stats is not None
        self.drops.stats += replaced
        self._stats = frame
        self.ready.set()
        return replaced

    def offer_log(self, frame: LogFrame) -> bool:
        """Queue a log frame, dropping the oldest when full; True when one was dropped."""
        dropped = len(self._log) >= self.log_bound
        if dropped:
            oldest = self._log.popleft()
            self.drops.lost_events(oldest.seq, oldest.seq)
        self._log.append(frame)
        self.ready.set()
        return dropped

    @property
    def pending_bytes(self) -> int:
        return len(self._stats or b"") + sum(len(f.data) for f in self._log)

    def take(self) -> bytes:
        """Everything unsent, in one write: what was dropped first, then the log in order, then stats."""
        self.ready.clear()
        parts = [dropped_frame(self.drops)] if self.drops else []
        parts += [f.data for f in self._log]
        if self._stats is not None:
            parts.append(self._stats)
        self.drops, self._stats = Drops(), None
        self._log.clear()
        return b"".join(parts)

    async def wait(self, timeout_s: float) -> bool:
        """Until something is ready (True) or ``timeout_s`` passed (False)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.ready.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.closed = True
        self.ready.set()


class StreamHub:
    """Every client of ``GET /v1/stream``, and the one task that feeds them while any is connected."""

    def __init__(self, service: EngineService, max_clients: int, log_bound: int = LOG_BOUND,
                 poll_s: float = LOG_POLL_S) -> None:
        self._service = service
        self.max_clients = max_clients
        self.log_bound = log_bound
        self._poll_s = poll_s
        self._subscribers: list[Subscriber] = []
        self._publisher: asyncio.Task[None] | None = None
        self._events: EventLog | None = None  # the log followed: the service's changes when the model loads
        self._cursor = 0  # the last event handed to the subscribers
        self._closed = False
        self.totals = StreamTotals()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def clients(self) -> tuple[Subscriber, ...]:
        return tuple(self._subscribers)

    @property
    def publishing(self) -> bool:
        return self._publisher is not None and not self._publisher.done()

    @property
    def cursor(self) -> int:
        return self._cursor

    def subscribe(self, options: StreamOptions) -> Subscriber:
        """A new client (its first stats frame at the next tick); 429 at the cap, 503 once shutting down."""
        if self._closed:
            raise EngineUnavailableError("the server is shutting down", retry_after_s=CAP_RETRY_AFTER_S)
        if len(self._subscribers) >= self.max_clients:
            self.totals.refused += 1
            raise ApiError(429, f"{len(self._subscribers)} live stream clients already (stream_max_clients "
                                f"{self.max_clients}); retry later", retry_after_s=CAP_RETRY_AFTER_S)
        loop = asyncio.get_running_loop()
        self._forward_log()  # so that a resume below and the publisher's next look never overlap
        subscriber = Subscriber(options, self.log_bound, loop.time())
        if options.after is not None:
            self._backfill(subscriber, options.after)
        self._subscribers.append(subscriber)
        if not self.publishing:
            self._publisher = loop.create_task(self._publish(), name="semantic-stream-publisher")
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """The client is gone: forget it now; the publisher stops with the last one."""
        subscriber.close()
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)
        if not self._subscribers and self._publisher is not None:
            self._publisher.cancel()
            self._publisher = None

    def close(self) -> None:
        """Shutdown: end every stream (they would otherwise hold the server's graceful exit to its deadline)."""
        self._closed = True
        for subscriber in list(self._subscribers):
            self.unsubscribe(subscriber)

    def _backfill(self, subscriber: Subscriber, after: int) -> None:
        events = [e for e in self._service.events.since(after) if e.seq <= self._cursor]
        oldest = events[0].seq if events else self._cursor + 1
        if oldest > after + 1:  # the ring no longer holds them
            subscriber.drops.lost_events(after + 1, oldest - 1)
        for event in events:
            self.totals.log_dropped += subscriber.offer_log(log_frame(event))

    async def _publish(self) -> None:
        loop = asyncio.get_running_loop()
        while self._subscribers:
            self._forward_log()
            self._send_stats(loop.time())
            earliest = min(s.due_at for s in self._subscribers)
            await asyncio.sleep(max(0.0, min(self._poll_s, earliest - loop.time())))

    def _forward_log(self) -> None:
        events = self._service.events
        if events is not self._events:
            self._events, self._cursor = events, 0
        if events.last_seq == self._cursor:
            return
        if not self._subscribers:
            self._cursor = events.last_seq
            return
        new = events.since(self._cursor)
        frames = [log_frame(e) for e in new]
        for subscriber in self._subscribers:
            for frame in frames:
                self.totals.log_dropped += subscriber.offer_log(frame)
        if new:
            self._cursor = new[-1].seq

    def _send_stats(self, now: float) -> None:
        built: dict[bool, bytes | None] = {}
        for subscriber in self._subscribers:
            if subscriber.due_at > now:
                continue
            blocks = subscriber.options.blocks
            if blocks not in built:
                built[blocks] = self._stats_frame(blocks)
            frame = built[blocks]
            if frame is not None:
                self.totals.stats_dropped += subscriber.offer_stats(frame)
            subscriber.due_at = next_tick(now, subscriber.options.interval_s)

    def _stats_frame(self, blocks: bool) -> bytes | None:
        try:
            body = build_stats(self._service, blocks).model_dump_json()
        except Exception:
            # A snapshot that cannot be described now (a model mid-unload) skips one tick, not the stream.
            log.exception("live stream: building the stats frame failed; skipping this tick")
            return None
        self.totals.stats_built += 1
        return b"event: stats\ndata: " + body.encode() + b"\n\n"
