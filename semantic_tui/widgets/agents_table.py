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
    ("priority", "Class", 8),  # the agent's class and priority level (0 most urgent), * when the operator set it
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
MEDIUM_COLUMNS = ("agent", "source", "state", "tier", "priority", "tokens", "reuse", "used")
MEDIUM_AGENT_WIDTH = 24
COMPACT_COLUMNS = ("agent", "state", "tier", "tokens", "reuse")
CELL_PADDING = 2  # DataTable pads every cell by one column on each side
# With several resident models (--extra-model): which model's cache each row is, after the agent's name.
MODEL_COLUMN = ("model", "Model", 12)
# An extra model's agent is keyed "<model alias><MODEL_KEY_SEP><agent id>" (the same id may live in two models);
# the default model's agents keep their plain ids.
MODEL_KEY_SEP = "\x1f"


def row_key(model: str | None, agent_id: str) -> str:
    return agent_id if model is None else f"{model}{MODEL_KEY_SEP}{agent_id}"


def split_key(key: str) -> tuple[str | None, str]:
    """(the extra model's alias, or None for the default model's agent; the agent id)."""
    model, sep, agent_id = key.partition(MODEL_KEY_SEP)
    return (model, agent_id) if sep else (None, key)
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
        self._others: tuple[tuple[str, AgentView], ...] = ()
        self._updated = 0.0
        self._children: set[str] = set()  # agents drawn under their session's main agent
        # Set by the app with several resident models: a Model column, and other models' agents as rows.
        self.default_model: str | None = None
        self.now = time.time  # injectable clock for deterministic snapshots

    def on_mount(self) -> None:
        self._set_columns(COLUMNS if self.default_model is None else self._wanted_columns())

    def on_resize(self) -> None:
        wanted = self._wanted_columns()
        if wanted != self._columns:
            self._set_columns(wanted)
            if self._last is not None:
                self.update_snapshot(self._last, force=True, others=self._others)

    def _wanted_columns(self) -> tuple[tuple[str, str, int], ...]:
        if self.default_model is None:
            return _columns_for(self.size.width)
        columns = _columns_for(max(0, self.size.width - MODEL_COLUMN[2] - CELL_PADDING))
        return (columns[0], MODEL_COLUMN, *columns[1:])

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

    def update_snapshot(self, snapshot: EngineSnapshot, force: bool = False,
                        others: tuple[tuple[str, AgentView], ...] = ()) -> None:
        """``others``: (model alias, agent) of the other resident models' agents (with ``default_model`` set)."""
        self._last, self._others = snapshot, others
        if self.default_model is not None and not any(k == "model" for k, _, _ in self._columns):
            self._set_columns(self._wanted_columns())
        rows = [(None, a) for a in snapshot.agents] + list(others)
        known = set(self._rows)
        fresh = {row_key(model, a.agent_id) for model, a in rows}
        if not force and fresh == known and time.monotonic() - self._updated < MIN_REFRESH_S:
            return
        self._updated = time.monotonic()
        rows = in_tree_order(rows)
        for gone in [k for k in self._rows if k not in fresh]:
            self.remove_row(gone)
            del self._rows[gone]
        ordered = [row_key(model, a.agent_id) for model, a in rows]
        appended = list(self._rows) + [k for k in ordered if k not in self._rows]
        if appended != ordered:  # an agent joined the rows of a session already drawn: redraw them in tree order
            self._reselect = self.selected_agent
            self.clear()
            self._rows.clear()
        # A subagent or side request drawn under its session's main agent (one with a main agent listed).
        roots = {(model, a.family) for model, a in rows if a.family is not None and is_root(a)}
        self._children = {a.agent_id for model, a in rows if not is_root(a) and (model, a.family) in roots}
        for model, agent in rows:
            self._upsert(model, agent)

    def _upsert(self, model: str | None, agent: AgentView) -> None:
        all_cells = dict(zip((key for key, _, _ in COLUMNS), self._cells(agent)))
        all_cells["model"] = _model_label(model or self.default_model or "")
        cells = tuple(all_cells[key] for key, _, _ in self._columns)
        key = row_key(model, agent.agent_id)
        previous = self._rows.get(key)
        if previous is None:
            self.add_row(*cells, key=key)
            if getattr(self, "_reselect", None) == key:
                self.move_cursor(row=self.get_row_index(key))
        else:
            for (column, _, _), old, new in zip(self._columns, previous, cells):
                if str(old) != str(new):
                    self.update_cell(key, column, new)
        self._rows[key] = cells

    def _cells(self, a: AgentView) -> tuple:
        pin = "* " if a.pinned else ""
        branch = "└ " if a.agent_id in self._children else ""
        limit = self._columns[0][2] - len(branch)
        # Under its session's row a child needs only its own part ("subagent 3f2a…" of "Claude Code 5f0c / subagent
        # 3f2a…"): the tree already says whose it is.
        label = a.label.rsplit(" / ", 1)[-1] if branch else a.label
        label = label if len(label) <= limit else label[: limit - 1] + "…"
        name = Text(branch + pin + label, style=agent_color(a.agent_id))
        return (
            name,
            SOURCE_LABELS.get(a.source, a.source),
            _state(a),
            Text(a.tier, style=TIER_STYLES.get(a.tier, "")),
            _priority(a),
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


def _model_label(alias: str) -> str:
    """A model's alias as the column shows it: a folder's name, cut to the column."""
    name = alias.rstrip("/").rsplit("/", 1)[-1]
    width = MODEL_COLUMN[2]
    return name if len(name) <= width else name[: width - 1] + "…"


def _drafts(a: AgentView) -> str:
    """Kept drafts and tokens per speculative step ("83% x3.1"), or "-" before any draft was verified."""
    tally = a.speculation
    return f"{tally.acceptance:.0%} x{tally.tokens_per_step:.1f}" if tally.drafted else "-"


CLASS_LABELS = {"interactive": "you", "main": "main", "side": "side", "subagent": "sub", "background": "bg"}


def _priority(a: AgentView) -> Text:
    """"sub 3": the class and the level its turns are served at; "*" when the operator set the level."""
    mark = "*" if a.priority_set else ""
    style = "bold" if a.priority <= 1 else "dim" if a.priority >= 5 else ""
    return Text(f"{CLASS_LABELS.get(a.agent_class, a.agent_class)} {a.priority}{mark}", style=style)


def in_tree_order(rows: list[tuple[str | None, AgentView]]) -> list[tuple[str | None, AgentView]]:
    """Rows as a tree: each client session's agents together (its main agent, then its subagents and side
    requests), sessions and agents in the order they started: rows stay where they are while agents work, and a
    new session's rows come last."""
    started: dict[object, float] = {}
    for model, a in rows:
        key = (model, a.family or a.agent_id)
        started[key] = min(started.get(key, a.created_at), a.created_at)

    def order(row: tuple[str | None, AgentView]) -> tuple:
        model, a = row
        key = (model, a.family or a.agent_id)
        return (started[key], str(key), not is_root(a), a.created_at, a.agent_id)

    return sorted(rows, key=order)


def is_root(a: AgentView) -> bool:
    return a.family is None or a.agent_class in ("main", "interactive", "background")


def _state(a: AgentView) -> Text:
    if a.paused:
        return Text("paused", style="yellow")
    if a.state == "queued" and a.queue_position:
        return Text(f"queued #{a.queue_position}", style="magenta")
    if a.state == "idle" and a.waiting_on_tool:
        return Text("tool wait", style="blue")
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
