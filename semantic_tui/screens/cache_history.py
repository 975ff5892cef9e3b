"""One agent's cache history: how each of its last turns met its cache, and where a prompt left it.

Opened with ``i`` on the agents table (or "agent: cache history" in the
palette). The table lists the agent's last turns; the panel below explains
the selected one: the outcome in words, and for a prompt that left the
cached tokens, a two-line diff (cached above, prompt below) with the
differing span highlighted. It follows the engine's snapshot while open.
"""

from __future__ import annotations

import time
from typing import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label, Static

from engine.domain.forensics import Divergence, TurnForensics
from engine.runtime.engine_thread.snapshot import AgentView, EngineSnapshot

from ..formatting import human_bytes, relative_time

OUTCOME_WORDS = {
    "full": "everything cached was reused",
    "new_agent": "a new agent: nothing was cached yet",
    "shared": "started from another agent's prefix",
    "diverged": "the prompt left the cached tokens before their end",
    "window": "sliding-window layers resumed from an earlier checkpoint",
    "snapshot": "recurrent state resumed from an earlier snapshot",
    "restored": "restored from disk (warm tier) and reused",
    "dropped": "the cache had been dropped (cold): full prefill",
    "model_changed": "the cache was made by another model",
    "side_request": "a side request served from the prefix; the agent's cache left as it was",
    "no_room": "the pool had no room to keep all of it",
}
COLUMNS = ("when", "outcome", "prompt", "cached", "reused", "prefilled", "from")


def _memory(view: AgentView) -> str:
    """What a hot agent of a hybrid or sliding-window model holds beside its K/V: state, snapshots, checkpoints."""
    parts = []
    if view.state_bytes:
        parts.append(f"state {human_bytes(view.state_bytes)}")
    if view.checkpoint_bytes:
        parts.append(f"{'snapshots' if view.state_bytes else 'checkpoints'} {human_bytes(view.checkpoint_bytes)}")
    return f"\n{human_bytes(view.bytes)} in the pool, of it " + ", ".join(parts) if parts else ""


def explain(turn: TurnForensics) -> Text:
    """The selected turn in words, with the divergence as a two-line diff."""
    text = Text()
    text.append(f"{turn.outcome.value}", style="bold")
    text.append(f": {OUTCOME_WORDS.get(turn.outcome.value, '')}\n")
    text.append(f"reused {turn.reused_tokens:,} of {turn.prompt_tokens:,} prompt tokens "
                f"(cache held {turn.cached_tokens:,}); prefilled {turn.prefilled_tokens:,}; from {turn.source}\n")
    if turn.note:
        text.append(f"engine: {turn.note}\n", style="italic")
    if turn.divergence is not None:
        text.append_text(divergence_diff(turn.divergence))
    return text


def divergence_diff(d: Divergence) -> Text:
    against = "its own cache" if d.against == "own cache" else f"agent {d.against}"
    text = Text()
    text.append(f"diverged from {against} at token {d.token:,} (block {d.block}, {d.region})")
    if d.volatile:
        text.append(f": {d.volatile}", style="bold")
    text.append("\n")
    end_cached, end_prompt = _differing_ends(d.cached_text, d.prompt_text, d.common_chars)
    for label, line, end in (("cached", d.cached_text, end_cached), ("prompt", d.prompt_text, end_prompt)):
        text.append(f"{label} │ ", style="dim")
        text.append(_visible(line[:d.common_chars]))
        text.append(_visible(line[d.common_chars:end]), style="reverse bold")
        text.append(_visible(line[end:]))
        text.append("\n")
    return text


def _differing_ends(cached: str, prompt: str, start: int) -> tuple[int, int]:
    """Where the differing span ends on each side: the texts also agree again after a short change."""
    common_tail = 0
    while (common_tail < min(len(cached), len(prompt)) - start
           and cached[len(cached) - 1 - common_tail] == prompt[len(prompt) - 1 - common_tail]):
        common_tail += 1
    return max(start + 1, len(cached) - common_tail), max(start + 1, len(prompt) - common_tail)


def _visible(text: str) -> str:
    return text.replace("\n", "⏎").replace("\t", "→")


class CacheHistoryScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    CacheHistoryScreen { align: center middle; }
    CacheHistoryScreen > Vertical { width: 96%; height: 90%; border: round $primary; padding: 0 1;
                                    background: $surface; }
    CacheHistoryScreen DataTable { height: 1fr; min-height: 5; }
    CacheHistoryScreen #detail { height: auto; max-height: 12; padding-top: 1; }
    """
    BINDINGS = [Binding("escape,q,i", "dismiss", "Close", id="cache_history.close")]

    def __init__(self, agent_id: str, snapshot: Callable[[], EngineSnapshot | None],
                 now: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.agent_id = agent_id
        self.snapshot = snapshot
        self.now = now
        self._shown: tuple[TurnForensics, ...] | None = None

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(id="title")
            yield DataTable(cursor_type="row", zebra_stripes=True)
            yield Static(id="detail")

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)
        self.refresh_history()
        self.set_interval(1.0, self.refresh_history)

    def _view(self) -> AgentView | None:
        snapshot = self.snapshot()
        return snapshot.agent(self.agent_id) if snapshot is not None else None

    def refresh_history(self) -> None:
        view = self._view()
        title = self.query_one("#title", Label)
        if view is None:
            title.update(f"[b]{self.agent_id}[/b]: no longer known to the engine")
            return
        title.update(f"[b]Cache history · {view.label}[/b] · {view.tier} · {view.cached_tokens:,} tokens cached · "
                     f"{view.turns} turns (last {len(view.history)} shown, newest last){_memory(view)}")
        if view.history == self._shown:
            return
        self._shown = view.history
        table = self.query_one(DataTable)
        table.clear()
        for turn in view.history:
            table.add_row(relative_time(turn.at, self.now()), turn.outcome.value, f"{turn.prompt_tokens:,}",
                          f"{turn.cached_tokens:,}", f"{turn.reused_tokens:,}", f"{turn.prefilled_tokens:,}",
                          turn.source, key=turn.request_id)
        if view.history:
            table.move_cursor(row=len(view.history) - 1)
            self._show(len(view.history) - 1)
        else:
            self.query_one("#detail", Static).update("No turns yet.")

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show(event.cursor_row)

    def _show(self, row: int) -> None:
        if self._shown and 0 <= row < len(self._shown):
            self.query_one("#detail", Static).update(explain(self._shown[row]))
