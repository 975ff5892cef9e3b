"""The workbench: live panes over one engine, chats, eviction controls, the HTTP API inside.

Embedded (``semantic``), the engine runs in its own thread of this process;
attached (``semantic attach``), it is a running server's. Either way the UI
reads the engine through one :class:`WorkbenchClient` (an immutable state a few
times a second, never a call into MLX) and steers its agents through the same
client, so both workbenches draw and act alike. Embedded, model loading runs in
a thread worker that posts progress messages.
"""

from __future__ import annotations

import logging
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.containers import Horizontal, Vertical
from textual.widgets import ContentSwitcher, Footer
from textual.worker import Worker, WorkerState

from engine.domain.priority import LEAST_URGENT, MOST_URGENT
from engine.errors import SemanticError
from engine.platform import slow_blas
from engine.settings import Settings
from engine.swap import release_thread_streams

from .backend import WorkbenchBackend
from .local_client import LocalClient
from .workbench_client import AgentAction, WorkbenchClient, WorkbenchState
from .messages import EngineStopped, LoadProgress, ModelFailed, ModelReady
from .palette import WorkbenchCommands
from .screens.cache_history import CacheHistoryScreen
from .screens.dialogs import ErrorDialog
from .branch_flow import BranchFlow
from .swap_flow import ModelSwapFlow
from .screens.loading import LoadingScreen
from .widgets.agents_hint import AgentsHint
from .widgets.agents_table import AgentsTable, split_key
from .widgets.chat_area import ChatArea
from .widgets.chat_pane import ChatPane
from .widgets.event_log import EventLogView
from .widgets.models_panel import ModelsPanel
from .widgets.pool_map import PoolMap
from .widgets.status_bar import StatusBar
from .widgets.throughput_panel import ThroughputPanel
from .widgets.tiers_panel import TiersPanel

log = logging.getLogger("semantic.tui")
# The top line's warning while MLX runs on its bundled reference BLAS (`semantic doctor` prints the fix).
SLOW_BLAS_WARNING = "SLOW BLAS (~30x): run `semantic doctor`"
BOTTOM_SIZES = (25, 40, 55, 70)  # percent of the screen for chats/log
# Below this many rows the side column shows one panel at a time (cycle with v)
# and open chats get more of the screen.
COMPACT_HEIGHT = 36
SIDE_PANELS = ("pool", "tiers", "throughput")


class SemanticApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "semantic"
    COMMANDS = App.COMMANDS | {WorkbenchCommands}
    BINDINGS = [
        Binding("q", "quit", "Quit", show=False, id="app.quit", tooltip="Persist agent caches and quit"),
        # Shown in the footer and heard everywhere, a chat's input too (where q is a letter to type).
        Binding("ctrl+q", "quit", "Quit", priority=True, id="app.quit_anywhere",
                tooltip="Persist agent caches and quit (also from a chat's input)"),
        Binding("c", "open_chat", "Chat", id="agent.open_chat", tooltip="Open a chat on the selected agent"),
        Binding("n", "new_chat", "New", id="chat.new", tooltip="Open a chat on a new agent"),
        Binding("e", "evict_warm", "Evict", id="agent.evict", tooltip="Evict the selected agent's cache to disk"),
        Binding("d", "drop", "Drop", id="agent.drop", tooltip="Drop the selected agent's cache (cold)"),
        Binding("p", "toggle_pin", "Pin", id="agent.pin", tooltip="Pin or unpin the selected agent"),
        Binding("right_square_bracket", "raise_priority", "Raise", show=False, id="agent.raise",
                tooltip="Serve the selected agent sooner (its priority level one more urgent)"),
        Binding("left_square_bracket", "lower_priority", "Lower", show=False, id="agent.lower",
                tooltip="Serve the selected agent later (its priority level one less urgent)"),
        Binding("space", "toggle_pause", "Pause", show=False, id="agent.pause",
                tooltip="Pause the selected agent's turns (its cache stays) or resume them"),
        Binding("i", "cache_history", "Cache", id="agent.cache_history",
                tooltip="How the selected agent's last turns met its cache, and why a turn prefilled"),
        Binding("f", "fork", "Fork", show=False, id="agent.fork", tooltip="Fork the selected agent: a new agent sharing its cache"),
        Binding("r", "rewind", "Rewind", show=False, id="agent.rewind", tooltip="Take the selected agent back to an earlier turn"),
        Binding("x", "export_agent", "Export", show=False, id="agent.export",
                tooltip="Write the selected agent to one file"),
        Binding("X", "import_agent", "Import", show=False, id="agent.import", tooltip="Install an exported agent file"),
        Binding("E", "evict_idle", "Evict idle", id="pool.evict_idle", tooltip="Evict every idle agent to disk"),
        Binding("l", "toggle_bottom", "Log/Chats", id="view.toggle_bottom", tooltip="Show the event log or the chats"),
        Binding("t", "cycle_theme", "Theme", id="view.theme", tooltip="Next theme (remembered)"),
        Binding("v", "cycle_side", "Side pane", id="view.side", tooltip="Show the next side panel (small terminals)"),
        Binding("m", "pick_model", "Model", id="model.swap", tooltip="Swap the loaded model (agents' caches are kept)"),
        Binding("z", "zoom", "Zoom", id="view.zoom", tooltip="Maximize the focused pane"),
        Binding("plus", "grow_bottom", "Taller", show=False, id="view.grow", tooltip="More rows for chats/log"),
        Binding("minus", "shrink_bottom", "Shorter", show=False, id="view.shrink", tooltip="Fewer rows for chats/log"),
        Binding("tab", "focus_next", "Next pane", show=False, id="view.focus_next"),
        Binding("ctrl+n", "next_pane", "Next chat", show=False, id="chat.next", tooltip="Focus the next chat pane"),
    ]

    def __init__(self, engine: WorkbenchBackend | WorkbenchClient, preferences: Any = None,
                 poll_interval_s: float = 0.5) -> None:
        """``engine``: the backend of the engine this process runs (embedded), or the client of a running
        server (attached)."""
        super().__init__()
        # Embedded only: chats, swaps, forks and exports still reach the engine in this process.
        self.backend = engine if isinstance(engine, WorkbenchBackend) else None
        self.client: WorkbenchClient = LocalClient(engine) if self.backend is not None else engine
        self.preferences = preferences
        self.poll_interval_s = poll_interval_s
        self._bottom = 1
        self._pending_levels: dict[tuple[str | None, str], int] = {}  # levels set, until the table shows them
        self._new_chats = 0
        self._side = 0
        self.swap_flow = ModelSwapFlow(self)
        self.branching = BranchFlow(self)

    # -- layout -----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        # This process's BLAS is the engine's only when the engine runs here.
        slow = self.backend is not None and slow_blas()
        yield StatusBar(id="status", blas_warning=SLOW_BLAS_WARNING if slow else None)
        with Horizontal(id="top"):
            with Vertical(id="agents-panel", classes="panel"):
                yield AgentsTable(id="agents")
                yield AgentsHint(id="agents-hint")
            with Vertical(id="side"):
                yield ModelsPanel(id="models", classes="panel")
                yield PoolMap(id="pool", classes="panel")
                yield TiersPanel(id="tiers", classes="panel")
                yield ThroughputPanel(id="throughput", classes="panel")
        with ContentSwitcher(id="bottom", initial="log"):
            yield EventLogView(id="log")
            yield ChatArea(self.client.chat, id="chats")
        yield Footer()

    def on_mount(self) -> None:
        self._apply_preferences()
        self.main.query_one("#agents-panel").border_title = "Agents"
        self.main.query_one("#models").border_title = "Models"
        self.main.query_one("#pool").border_title = "Block pool"
        self.main.query_one("#tiers").border_title = "Cache tiers"
        self.main.query_one("#throughput").border_title = "Throughput"
        self.main.query_one("#bottom").border_title = "Log"
        self._apply_size()
        self.set_interval(self.poll_interval_s, self.refresh_panes)
        if self.backend is None:
            self.client.start()
            self.main.query_one(StatusBar).url = self.client.address
            self.main.query_one(AgentsHint).url = self.client.address
            return
        self.push_screen(LoadingScreen(self.backend.settings.model))
        self.load_model()

    # -- model loading ----------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="model", exit_on_error=False, description="load model")
    def load_model(self) -> None:
        try:
            engine = self.backend.start_engine(lambda p: self.post_message(LoadProgress(p)))
        except SemanticError as exc:
            self.post_message(ModelFailed(f"Could not load {self.backend.settings.model}", str(exc)))
            return
        finally:
            release_thread_streams()  # this worker thread ends here; MLX needs its cleanup before that
        self.post_message(ModelReady(engine))

    @on(LoadProgress)
    def _load_progress(self, message: LoadProgress) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.screen.update_progress(message.progress)

    @on(ModelReady)
    async def _model_ready(self, message: ModelReady) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        await self._start_http()
        self.refresh_panes()

    @on(ModelFailed)
    def _model_failed(self, message: ModelFailed) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        self.push_screen(ErrorDialog(message.title, message.detail, ("quit", "retry")), self._after_failure)

    def _after_failure(self, choice: str | None) -> None:
        if choice == "retry":
            self.push_screen(LoadingScreen(self.backend.settings.model))
            self.load_model()
        else:
            self.exit()

    async def _start_http(self) -> None:
        try:
            listener = await self.backend.start_http()
        except (OSError, SystemExit) as exc:
            self.notify(f"HTTP API not started: {exc}", severity="error", timeout=10)
            return
        self.main.query_one(StatusBar).url = listener.url
        self.main.query_one(AgentsHint).url = listener.url
        self.notify(f"Point Claude Code at it: ANTHROPIC_BASE_URL={listener.url}", timeout=8)

    @on(Worker.StateChanged)
    def _worker_failed(self, event: Worker.StateChanged) -> None:
        if event.state is WorkerState.ERROR:
            error = event.worker.error
            self.push_screen(ErrorDialog(f"{event.worker.description} failed", f"{type(error).__name__}: {error}"))

    @property
    def main(self) -> Screen:
        """The dashboard screen, whatever modal (palette, dialog) is on top of it."""
        return self.screen_stack[0]

    # -- live panes ---------------------------------------------------------------------------
    def refresh_panes(self, force: bool = False) -> None:
        """Update every pane from the engine snapshot (``force``: even the throttled agents table)."""
        try:
            self._refresh_panes(force)
        except NoMatches:
            return  # the screen is being torn down (quit)

    def _refresh_panes(self, force: bool) -> None:
        if not self.screen_stack:
            return
        state = self.client.state()
        status = self.main.query_one(StatusBar)
        # The engine publishes no snapshot while it is stuck: the watchdog reading comes beside it.
        status.stalled_s = state.stalled_s
        status.link = state.link
        log_view = self.main.query_one(EventLogView)
        if log_view.display:  # a hidden log catches up when shown: rendering lines nobody sees costs CPU
            log_view.pull(self.client.events)
        if state.swap_phase is not None:
            status.phase = f"swap: {state.swap_phase}"
            return
        snapshot = state.snapshot
        if snapshot is None or snapshot.pool is None:
            return
        status.update_snapshot(snapshot)
        table = self.main.query_one(AgentsTable)
        shown = snapshot
        if state.models is not None:
            panel = self.main.query_one(ModelsPanel)
            panel.add_class("configured")
            table.default_model = state.models.default_alias
            shown, shown_alias = self._shown_model(state)
            panel.update_models(list(state.models.rows), state.models.budget, shown_alias)
            self._title_side_panes(shown_alias)
        table.update_snapshot(snapshot, force=force, others=state.other_agents)
        self.main.query_one(AgentsHint).display = not snapshot.agents
        # With several models the pool map, tiers and throughput are the selected agent's model's.
        self.main.query_one(PoolMap).update_snapshot(shown)
        self.main.query_one(TiersPanel).update_snapshot(shown)
        self.main.query_one(ThroughputPanel).update_snapshot(shown)
        self.main.query_one(ChatArea).set_batch_size(snapshot.throughput.batch_size)

    def _shown_model(self, state: WorkbenchState) -> tuple[Any, str]:
        """(the snapshot the side panes show, its model's alias): the selected row's model while it serves."""
        row = self.selected_row()
        shown = state.snapshot_of(row[0]) if row is not None and row[0] is not None else None
        if shown is None or shown.pool is None:
            return state.snapshot, state.models.default_alias
        return shown, row[0]

    def _title_side_panes(self, alias: str) -> None:
        for pane_id, title in (("#pool", "Block pool"), ("#tiers", "Cache tiers"), ("#throughput", "Throughput")):
            self.main.query_one(pane_id).border_title = f"{title} · {alias}"

    # -- agent actions --------------------------------------------------------------------------
    def selected_row(self) -> tuple[str | None, str] | None:
        """(the extra model's alias, or None for the default model's; the agent id) of the selected row."""
        key = self.main.query_one(AgentsTable).selected_agent
        return split_key(key) if key is not None else None

    def _chosen_row(self) -> tuple[str | None, str] | None:
        """The selected row, or None with a notice asking for one."""
        row = self.selected_row()
        if row is None:
            self.notify("Select an agent in the table first", severity="warning")
        return row

    def selected_agent(self) -> str | None:
        row = self.selected_row()
        return row[1] if row is not None else None

    def selected_agent_label(self) -> str | None:
        row = self.selected_row()
        if row is None:
            return None
        model, agent_id = row
        view = self._view(model, agent_id)
        label = view.label if view else agent_id
        return label if model is None else f"{label} of {model}"

    def _view(self, model: str | None, agent_id: str) -> Any:
        snapshot = self.client.state().snapshot_of(model)
        return snapshot.agent(agent_id) if snapshot else None

    async def _agent_action(self, verb: str, action: AgentAction) -> None:
        row = self._chosen_row()
        if row is None:
            return
        model, agent_id = row
        try:
            await self.client.agent_action(model, agent_id, action)
        except SemanticError as exc:
            self.notify(f"{verb} {agent_id}: {exc}", severity="error")
            return
        self.notify(f"{verb}: {agent_id}" + (f" ({model})" if model is not None else ""))
        self.refresh_panes(force=True)

    async def action_fork(self) -> None:
        await self.branching.fork()

    def action_rewind(self) -> None:
        self.branching.rewind()

    def action_export_agent(self) -> None:
        self.branching.export()

    def action_import_agent(self) -> None:
        self.branching.import_()

    async def action_evict_warm(self) -> None:
        await self._agent_action("Evicted to disk", AgentAction.EVICT)

    async def action_drop(self) -> None:
        await self._agent_action("Dropped", AgentAction.DROP)

    async def action_delete_agent(self) -> None:
        await self._agent_action("Deleted", AgentAction.DELETE)

    async def action_toggle_pin(self) -> None:
        row = self.selected_row()
        view = self._view(*row) if row is not None else None
        pinned = bool(view and view.pinned)
        await self._agent_action("Unpinned" if pinned else "Pinned", AgentAction.UNPIN if pinned else AgentAction.PIN)

    async def action_raise_priority(self) -> None:
        await self._steer_priority(-1)

    async def action_lower_priority(self) -> None:
        await self._steer_priority(+1)

    async def _steer_priority(self, step: int) -> None:
        row = self._chosen_row()
        view = self._view(*row) if row is not None else None
        if row is None or view is None:
            return
        # Keys pressed faster than the table refreshes step from the level last set, not the one still shown.
        pending = self._pending_levels.pop(row, None)
        base = pending if pending is not None and pending != view.priority else view.priority
        level = min(LEAST_URGENT, max(MOST_URGENT, base + step))
        self._pending_levels[row] = level
        await self._steer(row, f"Priority {level}", priority=level)

    async def action_toggle_pause(self) -> None:
        row = self._chosen_row()
        view = self._view(*row) if row is not None else None
        if row is not None and view is not None:
            await self._steer(row, "Resumed" if view.paused else "Paused", paused=not view.paused)

    async def _steer(self, row: tuple[str | None, str], verb: str, **change: Any) -> None:
        model, agent_id = row
        try:
            await self.client.steer(model, agent_id, **change)
        except SemanticError as exc:
            self.notify(f"{verb} {agent_id}: {exc}", severity="error")
            return
        self.notify(f"{verb}: {agent_id}")
        self.refresh_panes(force=True)

    async def action_evict_idle(self) -> None:
        await self._evict_idle(to_disk=True)

    async def action_drop_idle(self) -> None:
        await self._evict_idle(to_disk=False)

    async def _evict_idle(self, to_disk: bool) -> None:
        try:
            count = await self.client.evict_idle(to_disk)
        except SemanticError as exc:
            self.notify(str(exc), severity="error")
            return
        self.notify(f"{count} idle agents moved to {'warm' if to_disk else 'cold'}")
        self.refresh_panes(force=True)

    # -- chats -------------------------------------------------------------------------------------
    def action_cache_history(self) -> None:
        row = self._chosen_row()
        if row is not None:
            model, agent_id = row
            self.push_screen(CacheHistoryScreen(agent_id, lambda: self.client.state().snapshot_of(model)))

    async def action_open_chat(self) -> None:
        if self.selected_row() is None:
            await self.action_new_chat()
            return
        await self._open_selected()

    @on(AgentsTable.OpenRequested)
    async def _open_requested(self, message: AgentsTable.OpenRequested) -> None:
        await self._open_selected()

    async def _open_selected(self) -> None:
        row = self._chosen_row()
        if row is None:
            return
        model, agent_id = row
        if model is not None and self.client.state().snapshot_of(model) is None:
            self.notify(f"{agent_id}: the model {model} is not loaded now", severity="error")
            return
        view = self._view(model, agent_id)
        source = view.source if view else "tui"
        label = view.label if view else agent_id
        self._show_bottom("chats")
        await self.main.query_one(ChatArea).open_chat(agent_id, label, source, model=model)

    async def action_new_chat(self) -> None:
        await self._new_chat(None)

    def new_chat_on(self, model: str | None) -> None:
        self.run_worker(self._new_chat(model), exclusive=False)

    async def _new_chat(self, model: str | None) -> None:
        area, state = self.main.query_one(ChatArea), self.client.state()
        existing = {pane.agent_id for pane in area.panes}
        for snapshot in (state.snapshot, *state.extra.values()):
            existing |= {a.agent_id for a in (snapshot or _NoSnapshot()).agents}
        self._new_chats += 1
        while f"chat-{self._new_chats}" in existing:
            self._new_chats += 1
        try:
            agent_id = await self.client.chat.create(f"chat-{self._new_chats}", f"chat-{self._new_chats}")
        except SemanticError as exc:
            self.notify(f"New chat: {exc}", severity="error")
            return
        self._show_bottom("chats")
        # The workbench drives the chats it opens: in this process as a workbench agent, attached as a
        # direct-API agent of the server.
        await area.open_chat(agent_id, agent_id, "tui" if self.client.embedded else "api", read_only=False,
                             model=model)

    async def action_close_chat(self) -> None:
        area = self.main.query_one(ChatArea)
        pane = self._focused_pane()
        if pane is not None:
            await area.close_chat(pane.agent_id, pane.model)
        if area.pane_count == 0:
            self._show_bottom("log")

    def _focused_pane(self) -> ChatPane | None:
        node = self.focused
        while node is not None and not isinstance(node, ChatPane):
            node = node.parent
        return node

    def action_next_pane(self) -> None:
        self._show_bottom("chats")
        self.main.query_one(ChatArea).focus_next_pane()

    @on(ChatArea.Changed)
    def _chats_changed(self, message: ChatArea.Changed) -> None:
        if self.main.query_one(ChatArea).pane_count == 0:
            self._show_bottom("log")

    # -- view ---------------------------------------------------------------------------------------
    def action_toggle_bottom(self) -> None:
        current = self.main.query_one("#bottom", ContentSwitcher).current
        self._show_bottom("log" if current == "chats" else "chats")

    def show_chats(self) -> None:
        self._show_bottom("chats")

    def _show_bottom(self, which: str) -> None:
        switcher = self.main.query_one("#bottom", ContentSwitcher)
        switcher.current = which
        switcher.set_class(which == "chats", "chats-open")
        switcher.border_title = "Chats" if which == "chats" else "Log"

    def on_resize(self) -> None:
        self._apply_size()

    def _apply_size(self) -> None:
        compact = self.size.height < COMPACT_HEIGHT
        side = self.main.query_one("#side")
        side.set_class(compact, "compact")
        for index, name in enumerate(SIDE_PANELS):
            self.main.query_one(f"#{name}").set_class(index == self._side, "shown")
        self.main.query_one("#bottom").set_class(compact, "compact")

    def action_cycle_side(self) -> None:
        self._side = (self._side + 1) % len(SIDE_PANELS)
        self._apply_size()

    def action_zoom(self) -> None:
        if self.screen.maximized is not None:
            self.screen.minimize()
        elif self.focused is not None:
            self.screen.maximize(self.focused)

    def action_grow_bottom(self) -> None:
        self._resize_bottom(+1)

    def action_shrink_bottom(self) -> None:
        self._resize_bottom(-1)

    def _resize_bottom(self, step: int) -> None:
        self._bottom = max(0, min(len(BOTTOM_SIZES) - 1, self._bottom + step))
        self.main.query_one("#bottom").styles.height = f"{BOTTOM_SIZES[self._bottom]}%"

    def action_copy_address(self) -> None:
        address = self.client.address
        if address is None:
            self.notify("The HTTP API is not listening yet", severity="warning")
            return
        self.copy_to_clipboard(address)
        self.notify(f"Copied {address}")

    # -- themes and preferences ----------------------------------------------------------------------
    def _apply_preferences(self) -> None:
        from themes import load_themes

        for theme in load_themes():
            self.register_theme(theme)
        prefs = self.preferences
        if prefs is not None:
            if prefs.keymap:
                self.set_keymap(prefs.keymap)
            if prefs.theme in self.available_themes:
                self.theme = prefs.theme
                return
        self.theme = "semantic-dark"

    def theme_choices(self) -> list[str]:
        from themes import THEME_CHOICES

        return [name for name in THEME_CHOICES if name in self.available_themes]

    def set_theme(self, name: str) -> None:
        self.theme = name
        if self.preferences is not None:
            self.preferences.theme = name
            self.preferences.save()

    def action_cycle_theme(self) -> None:
        choices = self.theme_choices()
        index = choices.index(self.theme) if self.theme in choices else -1
        self.set_theme(choices[(index + 1) % len(choices)])
        self.notify(f"Theme: {self.theme}")

    # -- model swaps ----------------------------------------------------------------------------------
    def model_commands(self) -> list[tuple[str, str, Any]]:
        return self.swap_flow.palette_commands() if self.backend is not None else []

    def action_pick_model(self) -> None:
        self.swap_flow.pick()

    # -- shutdown -------------------------------------------------------------------------------------
    async def action_quit(self) -> None:
        if self.backend is None:  # attached: the server keeps running
            await self.client.close()
            self.exit()
            return
        self.notify("Saving agent caches…", timeout=30)
        await self.client.close()
        self.stop_engine()

    @work(thread=True, exclusive=True, group="shutdown", exit_on_error=False, description="stop engine")
    def stop_engine(self) -> None:
        self.backend.stop_engine()
        self.post_message(EngineStopped())

    @on(EngineStopped)
    def _engine_stopped(self) -> None:
        self.exit()


class _NoSnapshot:
    agents: tuple = ()


def run_workbench(settings: Settings, world: Any = None) -> int:
    """The workbench; with a ``world`` (rank 0 of a sharded model) its engine follows lockstep."""
    from functools import partial

    from .backend import real_engine_factory
    from .preferences import load_preferences

    from engine.bootstrap import release_mlx

    app = SemanticApp(WorkbenchBackend(settings, partial(real_engine_factory, world=world)), load_preferences())
    app.run()
    del app
    release_mlx()
    return 0
