"""The workbench side of fork, rewind, export and import (engine/runtime/tiers/branching.py,
engine/store/agent_export.py).

- fork (``f``): a new agent sharing the selected agent's cache; a chat pane opens on it. A
  workbench chat's history is copied into the fork's pane, so its next message extends the
  shared cache; a fork of another client's agent (Claude Code, OpenAI) holds that client's
  context, which the pane cannot render, so its pane starts a conversation of its own.
- rewind (``r``): a picker of the agent's turns with their token counts; the cache is cut
  there, and an open workbench pane on it forgets the later messages.
- export (``x``) / import (``X``): a path prompt; the file work runs on a worker thread.

With several resident models every action is the selected agent's model's, and an
import goes to the serving model that made the file.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from engine.errors import SemanticError
from engine.domain.requests import AgentSource
from engine.runtime.engine_thread.snapshot import AgentView
from engine.store.agent_export import export_agent, import_agent
from engine.store.agents_on_disk import ModelKey
from engine.store.cache_file import read_header
from engine.runtime.engine_thread.engine_ops import engine_op

from .agent_target import ModelTarget
from .screens.branching import PathPrompt, TurnPicker
from .widgets.chat_area import ChatArea
from .workbench_host import WorkbenchHost



class BranchFlow:
    """Each action goes to the model that holds the selected agent (agent_target.py); an import goes to the
    serving model that made the file (the default model when none did: it then says which model it wants)."""

    def __init__(self, app: WorkbenchHost) -> None:
        self.app = app
        self._forks = 0

    @property
    def service(self) -> Any:
        return self.app.backend.service

    def _selected(self) -> tuple[ModelTarget, AgentView] | None:
        selected = self.app.selected_target()
        if selected is None:
            return None
        target, agent_id = selected
        snapshot = target.snapshot(self.service)
        view = snapshot.agent(agent_id) if snapshot is not None else None
        if view is None:
            self.app.notify(f"{agent_id}{target.suffix} is no longer known to its model", severity="warning")
            return None
        return target, view

    def _fail(self, verb: str, agent_id: str, exc: BaseException) -> None:
        self.app.notify(f"{verb} {agent_id}: {exc}", severity="error", timeout=8)

    # -- fork ------------------------------------------------------------------------------
    async def fork(self) -> None:
        """Fork the selected agent through the workbench's client (embedded or attached); embedded, a chat
        opens on the fork."""
        row = self.app.selected_row()
        snapshot = self.app.client.state().snapshot_of(row[0]) if row is not None else None
        view = snapshot.agent(row[1]) if snapshot is not None else None
        if view is None:
            self.app.notify("Select an agent its model still knows first", severity="warning")
            return
        model, suffix = row[0], f" ({row[0]})" if row[0] is not None else ""
        existing = {a.agent_id for a in snapshot.agents}
        self._forks += 1
        while f"{view.agent_id}-fork-{self._forks}" in existing:
            self._forks += 1
        new_id = f"{view.agent_id}-fork-{self._forks}"
        try:
            forked = await self.app.client.fork(model, view.agent_id, new_id, f"fork of {view.label}")
        except SemanticError as exc:
            self._fail("Fork", view.agent_id, exc)
            return
        if self.app.backend is not None:
            await self._chat_on_fork(view, forked.agent_id, model)
        self.app.notify(f"{forked.agent_id}: {forked.tokens:,} tokens from {view.agent_id}, "
                        f"{forked.shared_tokens:,} of them shared by reference{suffix}", title="Forked")
        self.app.refresh_panes(force=True)

    async def _chat_on_fork(self, view: AgentView, new_id: str, model: str | None) -> None:
        area = self.app.main.query_one(ChatArea)
        source_pane = area.pane_for(view.agent_id, model)
        self.app.show_chats()
        pane = await area.open_chat(new_id, f"fork of {view.label}", AgentSource.TUI.value, read_only=False,
                                    model=model)
        if pane is not None and source_pane is not None and view.source == AgentSource.TUI.value:
            pane.history = list(source_pane.history)

    # -- rewind ----------------------------------------------------------------------------
    def rewind(self) -> None:
        selected = self._selected()
        if selected is None:
            return
        target, view = selected
        if not view.turn_ends:
            self.app.notify(f"{view.label}: no turns recorded since it was loaded; nothing to go back to",
                            severity="warning")
            return
        picker = TurnPicker(f"Rewind {view.label} to the end of…", view.turn_ends, view.cached_tokens)
        self.app.push_screen(picker, lambda turn: self._rewind_to(target, view, turn) if turn is not None else None)

    def _rewind_to(self, target: ModelTarget, view: AgentView, turn: int) -> None:
        self.app.run_worker(self._do_rewind(target, view, turn), exclusive=False)

    async def _do_rewind(self, target: ModelTarget, view: AgentView, turn: int) -> None:
        try:
            branch = await target.call(self.service, engine_op("rewind_agent", view.agent_id, turn))
        except SemanticError as exc:
            self._fail("Rewind", view.agent_id, exc)
            return
        pane = self.app.main.query_one(ChatArea).pane_for(view.agent_id, target.model)
        if pane is not None and not pane.read_only:
            pane.history = pane.history[: 2 * turn]
            await pane.transcript.add_note(f"rewound to the end of turn {turn}: later messages are forgotten")
        self.app.notify(f"{view.agent_id}: back to turn {turn}, {branch.tokens:,} tokens kept{target.suffix}",
                        title="Rewound")

    # -- export and import -------------------------------------------------------------------
    def export(self) -> None:
        selected = self._selected()
        if selected is None:
            return
        target, view = selected
        default = str(Path.cwd() / f"{view.agent_id}.agent.safetensors")
        self.app.push_screen(PathPrompt(f"Export {view.label}{target.suffix} to", default),
                             lambda path: self.app.run_worker(self._do_export(target, view, Path(path)))
                             if path else None)

    async def _do_export(self, target: ModelTarget, view: AgentView, path: Path) -> None:
        try:
            write = await target.call(self.service, engine_op("write_agent", view.agent_id))
            if write is not None:
                await asyncio.wrap_future(write)
            key = _key_of(target.running_engine(self.service).loaded)
            summary = await asyncio.to_thread(export_agent, self.service.settings.cache_dir, view.agent_id,
                                              path.expanduser(), key)
        except (SemanticError, OSError) as exc:
            self._fail("Export", view.agent_id, exc)
            return
        self.app.notify(f"{summary.n_tokens:,} tokens, {summary.nbytes / 2**20:.1f} MiB -> {summary.path}",
                        title=f"Exported {view.agent_id}")

    def import_(self) -> None:
        self.app.push_screen(PathPrompt("Import an agent file"),
                             lambda path: self.app.run_worker(self._do_import(Path(path))) if path else None)

    async def _do_import(self, path: Path) -> None:
        cache_dir, path = self.service.settings.cache_dir, path.expanduser()
        try:
            header = await asyncio.to_thread(read_header, path)
            alias, engine = self.service.import_target(ModelKey.of_header(header))
            target = ModelTarget(None if engine is self.service.engine else alias, engine)
            await target.call(self.service, engine_op("check_import", header.agent_id, False))
            summary = await asyncio.to_thread(import_agent, cache_dir, path, None, _key_of(engine.loaded))
            await target.call(self.service, engine_op("adopt_agent", summary.path))
        except (SemanticError, OSError) as exc:
            self._fail("Import", str(path), exc)
            return
        self.app.notify(f"{summary.agent_id}: {summary.n_tokens:,} tokens, warm (its next turn reads it "
                        f"back){target.suffix}", title="Imported")


def _key_of(loaded: Any) -> ModelKey:
    return ModelKey.of_model(loaded.identity, loaded.spec)
