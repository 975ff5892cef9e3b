"""The engine's event log: load, admit, evict, restore, discard, errors."""

from __future__ import annotations

import logging
import time

from rich.text import Text
from textual.widgets import RichLog

from engine.domain.event_log import EventKind, EventLog

KIND_STYLES = {
    EventKind.EVICT: "yellow",
    EventKind.RESTORE: "green",
    EventKind.DISCARD: "bold red",
    EventKind.ERROR: "bold red",
    EventKind.SHARE: "cyan",
    EventKind.LOAD: "bold",
    EventKind.SWAP: "bold magenta",
    EventKind.ADMIT: "dim",
    EventKind.FINISH: "dim",
}


class EventLogView(RichLog):
    DEFAULT_CSS = """
    EventLogView { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None, max_lines: int = 2000) -> None:
        super().__init__(id=id, max_lines=max_lines, wrap=True, markup=False, highlight=False)
        self._seen = 0
        self.show_clock = True  # snapshot tests turn the wall clock off

    def pull(self, log: EventLog) -> int:
        """Append events newer than the last pulled; returns how many."""
        events = log.since(self._seen)
        for event in events:
            self.write(self._line(event))
            self._seen = event.seq
        return len(events)

    def _line(self, event) -> Text:
        line = Text()
        if self.show_clock:
            line.append(time.strftime("%H:%M:%S ", time.localtime(event.at)), style="dim")
        style = "bold red" if event.level >= logging.WARNING and event.kind is not EventKind.EVICT else KIND_STYLES.get(event.kind, "")
        line.append(f"{event.kind.value:<8}", style=style)
        line.append(event.message)
        return line
