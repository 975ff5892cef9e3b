"""The workbench side of fork, rewind, export and import (engine/runtime/tiers/branching.py,
engine/store/agent_export.py).

- fork (``f``): a new agent sharing the selected agent's cache; a chat pane opens on it. A
  workbench chat's history is copied into the fork's pane, so its next message extends the
  shared cache; a fork of another client's agent (Claude Code, OpenAI) holds that client's
  context, which the pane cannot render, so its pane starts a conversation of its own.
- rewind (``r``): a picker of the agent's turns with their token counts; the cache is cut
  there (attached: on the server, and a direct agent's conversation with it), and an open
  workbench pane on it forgets the later messages.
- export (``x``) / import (``X``): a path prompt; the file is on this machine (attached:
  downloaded from the server, or uploaded to it); the disk work runs on worker threads.

Every action goes through the workbench's client (workbench_client.py), so the embedded
and the attached workbench do the same. With several resident models every action is the
selected agent's model's, and an import goes to the serving model that made the file.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import SemanticError
from engine.domain.requests import AgentSource
from engine.runtime.engine_thread.snapshot import AgentView

from .screens.branching import PathPrompt, TurnPicker
from .widgets.chat_area import ChatArea
from .workbench_host import WorkbenchHost


class BranchFlow:
    """Each action goes to the model that holds the selected agent; an import goes to the serving model that
    made the file (the default model when none did: it then says which model it wants)."""

    def __init__(self, app: WorkbenchHost) -> None:
        self.app = app
        self._forks = 0

    def _fail(self, verb: str, agent_id: str, exc: BaseException) -> None:
        self.app.notify(f"{verb} {agent_id}: {exc}", severity="error", timeout=8)

    # -- fork ------------------------------------------------------------------------------
    async def fork(self) -> None:
        """Fork the selected agent through the workbench's client (embedded or attached); a chat opens on the
        fork where this workbench can drive it (embedded always; attached, the fork of a direct-API agent with a
        conversation, which the server copies)."""
        selected = self._selected_view()
        if selected is None:
            return
        model, view = selected
        suffix = f" ({model})" if model is not None else ""
        snapshot = self.app.client.state().snapshot_of(model)
        existing = {a.agent_id for a in snapshot.agents} if snapshot is not None else set()
        self._forks += 1
        while f"{view.agent_id}-fork-{self._forks}" in existing:
            self._forks += 1
        new_id = f"{view.agent_id}-fork-{self._forks}"
        try:
            forked = await self.app.client.fork(model, view.agent_id, new_id, f"fork of {view.label}")
        except SemanticError as exc:
            self._fail("Fork", view.agent_id, exc)
            return
        if self.app.client.embedded or (forked.conversation and self.app.client.chat.drives(view.source)):
            await self._chat_on_fork(view, forked.agent_id, model)
        self.app.notify(f"{forked.agent_id}: {forked.tokens:,} tokens from {view.agent_id}, "
                        f"{forked.shared_tokens:,} of them shared by reference{suffix}", title="Forked")
        self.app.refresh_panes(force=True)

    async def _chat_on_fork(self, view: AgentView, new_id: str, model: str | None) -> None:
        area = self.app.main.query_one(ChatArea)
        source_pane = area.pane_for(view.agent_id, model)
        self.app.show_chats()
        source = AgentSource.TUI.value if self.app.client.embedded else view.source
        pane = await area.open_chat(new_id, f"fork of {view.label}", source, read_only=False, model=model)
        if pane is not None and source_pane is not None and view.source == AgentSource.TUI.value:
            pane.history = list(source_pane.history)

    def _selected_view(self) -> tuple[str | None, AgentView] | None:
        """(the model, the view) of the selected row, from the workbench's client (embedded or attached)."""
        row = self.app.selected_row()
        snapshot = self.app.client.state().snapshot_of(row[0]) if row is not None else None
        view = snapshot.agent(row[1]) if snapshot is not None else None
        if view is None:
            self.app.notify("Select an agent its model still knows first", severity="warning")
            return None
        return row[0], view

    # -- rewind ----------------------------------------------------------------------------
    def rewind(self) -> None:
        """Through the workbench's client: embedded, on the engine; attached, POST /v1/agents/{id}/rewind."""
        selected = self._selected_view()
        if selected is None:
            return
        model, view = selected
        if not view.turn_ends:
            self.app.notify(f"{view.label}: no turns recorded since it was loaded; nothing to go back to",
                            severity="warning")
            return
        picker = TurnPicker(f"Rewind {view.label} to the end of…", view.turn_ends, view.cached_tokens)
        self.app.push_screen(picker, lambda turn: self._rewind_to(model, view, turn) if turn is not None else None)

    def _rewind_to(self, model: str | None, view: AgentView, turn: int) -> None:
        self.app.run_worker(self._do_rewind(model, view, turn), exclusive=False)

    async def _do_rewind(self, model: str | None, view: AgentView, turn: int) -> None:
        try:
            tokens = await self.app.client.rewind(model, view.agent_id, turn)
        except SemanticError as exc:
            self._fail("Rewind", view.agent_id, exc)
            return
        pane = self.app.main.query_one(ChatArea).pane_for(view.agent_id, model)
        if pane is not None and not pane.read_only:
            pane.history = pane.history[: 2 * turn]
            await pane.transcript.add_note(f"rewound to the end of turn {turn}: later messages are forgotten")
        suffix = f" ({model})" if model is not None else ""
        self.app.notify(f"{view.agent_id}: back to turn {turn}, {tokens:,} tokens kept{suffix}", title="Rewound")
        self.app.refresh_panes(force=True)

    # -- export and import -------------------------------------------------------------------
    def export(self) -> None:
        selected = self._selected_view()
        if selected is None:
            return
        model, view = selected
        suffix = f" ({model})" if model is not None else ""
        default = str(Path.cwd() / f"{view.agent_id}.agent.safetensors")
        self.app.push_screen(PathPrompt(f"Export {view.label}{suffix} to", default),
                             lambda path: self.app.run_worker(self._do_export(model, view, Path(path)))
                             if path else None)

    async def _do_export(self, model: str | None, view: AgentView, path: Path) -> None:
        """Through the workbench's client: embedded, from the engine's cache files; attached, downloaded from
        the server. Either way the file lands on this machine."""
        try:
            done = await self.app.client.export_agent(model, view.agent_id, path.expanduser())
        except (SemanticError, OSError) as exc:
            self._fail("Export", view.agent_id, exc)
            return
        self.app.notify(f"{done.tokens:,} tokens, {done.nbytes / 2**20:.1f} MiB -> {done.path}",
                        title=f"Exported {view.agent_id}")

    def import_(self) -> None:
        self.app.push_screen(PathPrompt("Import an agent file"),
                             lambda path: self.app.run_worker(self._do_import(Path(path))) if path else None)

    async def _do_import(self, path: Path) -> None:
        path = path.expanduser()
        try:
            done = await self.app.client.import_agent(path)
        except (SemanticError, OSError) as exc:
            self._fail("Import", str(path), exc)
            return
        suffix = f" ({done.model})" if done.model is not None else ""
        self.app.notify(f"{done.agent_id}: {done.tokens:,} tokens, warm (its next turn reads it back){suffix}",
                        title="Imported")
        self.app.refresh_panes(force=True)


