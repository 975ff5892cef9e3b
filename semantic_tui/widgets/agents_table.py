"""The agents table: every agent the engine knows, hot, warm or cold."""

from __future__ import annotations

import time

from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable

from engine.runtime.engine_thread.snapshot import AgentView, EngineSnapshot

from ..agent_colors import TIER_STYLES, agent_color
from ..formatting import human_bytes, relative_time

# Fixed widths: columns never jump as states and numbers change.
COLUMNS = (
    ("agent", "Agent", 30),
    ("source", "Source", 12),
    ("state", "State", 12),
    ("tier", "Tier", 5),
    ("tokens", "Tokens", 8),
    ("blocks", "Blocks", 14),
    ("reuse", "Reuse", 5),
    ("ttft", "TTFT", 6),
    ("rate", "tok/s", 6),
    ("think", "Think", 6),  # a thinking model's reasoning tokens in the last turn
    ("spec", "Drafts", 9),  # speculative decoding: drafts kept, and tokens per speculative step
    ("used", "Last used", 9),
)
COMPACT_AGENT_WIDTH = 18
# Narrower panels drop columns, least important first.
# The medium set keeps the source (workbench, Claude Code, OpenAI, API); blocks
# and TTFT are also shown by the pool map and the throughput panel.
MEDIUM_COLUMNS = ("agent", "source", "state", "tier", "tokens", "reuse", "rate", "used")
MEDIUM_AGENT_WIDTH = 24
COMPACT_COLUMNS = ("agent", "state", "tier", "tokens", "reuse")
CELL_PADDING = 2  # DataTable pads every cell by one column on each side
# The table redraws every visible cell when any cell changes; once a second is enough.
MIN_REFRESH_S = 1.0
SOURCE_LABELS = {"claude-code": "Claude Code", "codex": "Codex CLI", "tui": "workbench", "openai": "OpenAI", "anthropic": "Anthropic", "api": "API", "bench": "bench"}


class AgentsTable(DataTable):
    """Rows are keyed by agent id and updated cell by cell, never rebuilt."""

    DEFAULT_CSS = """
    AgentsTable { height: 1fr; }
    """
    BINDINGS = [Binding("enter", "open_selected", "Open chat", show=False, id="agents.open", tooltip="Open a chat on this agent")]

    class OpenRequested(Message):
        def __init__(self, agent_id: str) -> None:
            super().__init__()
            self.agent_id = agent_id

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._rows: dict[str, tuple] = {}
        self._columns: tuple[tuple[str, str, int], ...] = ()
        self._last: EngineSnapshot | None = None
        self._updated = 0.0
        self.now = time.time  # injectable clock for deterministic snapshots

    def on_mount(self) -> None:
        self._set_columns(COLUMNS)

    def on_resize(self) -> None:
        wanted = _columns_for(self.size.width)
        if wanted != self._columns:
            self._set_columns(wanted)
            if self._last is not None:
                self.update_snapshot(self._last, force=True)

    def _set_columns(self, columns: tuple[tuple[str, str, int], ...]) -> None:
        selected = self.selected_agent if self.row_count else None
        self.clear(columns=True)
        self._rows.clear()
        self._columns = columns
        for key, label, width in columns:
            self.add_column(label, key=key, width=width)
        self._reselect = selected

    @property
    def selected_agent(self) -> str | None:
        if self.row_count == 0:
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        return row_key.value

    def update_snapshot(self, snapshot: EngineSnapshot, force: bool = False) -> None:
        self._last = snapshot
        known = set(self._rows)
        fresh = {a.agent_id for a in snapshot.agents}
        if not force and fresh == known and time.monotonic() - self._updated < MIN_REFRESH_S:
            return
        self._updated = time.monotonic()
        agents = sorted(snapshot.agents, key=lambda a: -a.last_used)
        live = {a.agent_id for a in agents}
        for gone in [k for k in self._rows if k not in live]:
            self.remove_row(gone)
            del self._rows[gone]
        for agent in agents:
            self._upsert(agent)

    def _upsert(self, agent: AgentView) -> None:
        all_cells = dict(zip((key for key, _, _ in COLUMNS), self._cells(agent)))
        cells = tuple(all_cells[key] for key, _, _ in self._columns)
        previous = self._rows.get(agent.agent_id)
        if previous is None:
            self.add_row(*cells, key=agent.agent_id)
            if getattr(self, "_reselect", None) == agent.agent_id:
                self.move_cursor(row=self.get_row_index(agent.agent_id))
        else:
            for (key, _, _), old, new in zip(self._columns, previous, cells):
                if str(old) != str(new):
                    self.update_cell(agent.agent_id, key, new)
        self._rows[agent.agent_id] = cells

    def _cells(self, a: AgentView) -> tuple:
        pin = "* " if a.pinned else ""
        limit = self._columns[0][2]
        label = a.label if len(a.label) <= limit else a.label[: limit - 1] + "…"
        name = Text(pin + label, style=agent_color(a.agent_id))
        return (
            name,
            SOURCE_LABELS.get(a.source, a.source),
            _state(a),
            Text(a.tier, style=TIER_STYLES.get(a.tier, "")),
            f"{a.cached_tokens:,}",
            f"{a.blocks}·{human_bytes(a.bytes)}" if a.blocks else ("-" if a.tier != "warm" else human_bytes(a.bytes)),
            f"{a.reuse_ratio:.0%}" if a.turns else "-",
            f"{a.last_ttft_s:.2f}s" if a.last_ttft_s is not None else "-",
            f"{a.decode_tok_s:.1f}" if a.decode_tok_s else "-",
            f"{a.last_reasoning_tokens:,}" if a.last_reasoning_tokens else "-",
            _drafts(a),
            relative_time(a.last_used, self.now()),
        )

    def action_open_selected(self) -> None:
        agent = self.selected_agent
        if agent is not None:
            self.post_message(self.OpenRequested(agent))


# An idle agent whose last turn the server ended says so, until its next turn.
ENDED_BY_SERVER = {"repetition": "loop cut", "capacity": "pool full", "error": "failed"}


def _drafts(a: AgentView) -> str:
    """Kept drafts and tokens per speculative step ("83% x3.1"), or "-" before any draft was verified."""
    tally = a.speculation
    return f"{tally.acceptance:.0%} x{tally.tokens_per_step:.1f}" if tally.drafted else "-"


def _state(a: AgentView) -> Text:
    if a.state == "prefilling" and a.prefill_total:
        return Text(f"prefill {a.prefill_done / a.prefill_total:.0%}", style="cyan")
    if a.state == "idle" and a.last_finish in ENDED_BY_SERVER:
        return Text(f"idle·{ENDED_BY_SERVER[a.last_finish]}", style="yellow")
    styles = {"decoding": "green", "queued": "magenta", "prefilling": "cyan"}
    return Text(a.state, style=styles.get(a.state, "dim"))


def _columns_for(width: int) -> tuple[tuple[str, str, int], ...]:
    """The widest column set that fits ``width`` cells."""
    medium = tuple((k, label, MEDIUM_AGENT_WIDTH if k == "agent" else w) for k, label, w in COLUMNS if k in MEDIUM_COLUMNS)
    compact = tuple((k, label, COMPACT_AGENT_WIDTH if k == "agent" else w) for k, label, w in COLUMNS if k in COMPACT_COLUMNS)
    for columns in (COLUMNS, medium):
        if sum(w + CELL_PADDING for _, _, w in columns) <= width:
            return columns
    return compact
