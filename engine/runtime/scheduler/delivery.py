"""Handing a turn's events to its client and to whoever watches its agent (the workbench's live view)."""

from __future__ import annotations

import logging

from engine.domain.requests import EngineEvent, EventSink
from engine.runtime.scheduler.turn import Turn

log = logging.getLogger("semantic.engine")


class Delivery:
    def __init__(self) -> None:
        self.watchers: dict[str, list[EventSink]] = {}

    def watch(self, agent_id: str, sink: EventSink) -> None:
        """Also send every event of ``agent_id``'s turns to ``sink``."""
        self.watchers.setdefault(agent_id, []).append(sink)

    def unwatch(self, agent_id: str, sink: EventSink) -> None:
        sinks = self.watchers.get(agent_id, [])
        if sink in sinks:
            sinks.remove(sink)

    def emit(self, turn: Turn, event: EngineEvent) -> None:
        """Deliver an event; a sink that raises is detached (and its turn cancelled), nobody else is touched."""
        try:
            turn.sink(event)
        except Exception:
            log.exception("event sink of %s failed; detaching it", turn.request_id)
            turn.sink_failed()
        for watcher in list(self.watchers.get(turn.request.agent_id, ())):
            try:
                watcher(event)
            except Exception:
                log.exception("a watcher of %s failed; detaching it", turn.request.agent_id)
                self.unwatch(turn.request.agent_id, watcher)
