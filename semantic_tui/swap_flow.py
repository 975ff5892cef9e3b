"""The workbench side of a model swap: pick, confirm what will be spilled, follow progress."""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

from engine.errors import SemanticError
from engine.models.registry import RegistryEntry
from engine.swap import SwapPhase, SwapStatus, release_thread_streams

from .screens.dialogs import ConfirmDialog, ErrorDialog
from .screens.model_picker import ModelPicker, SwapProgressScreen, describe, swap_plan
from .workbench_host import WorkbenchHost



class ModelSwapFlow:
    def __init__(self, app: WorkbenchHost) -> None:
        self.app = app

    @property
    def service(self) -> Any:
        return self.app.backend.service

    def palette_commands(self) -> list[tuple[str, str, Any]]:
        """``model: swap to X`` for every registry model that is not loaded; with --extra-model, ``model: load
        X`` / ``model: unload X``, ``model: pin X`` / ``unpin X`` and ``chat: new on X`` for each extra
        model."""
        commands = self._resident_commands()
        if self.service.swapper is None:
            return commands
        return commands + [
            (f"model: swap to {entry.model_id}", describe(entry), partial(self.confirm, entry))
            for entry in self.service.registry.entries()
            if not entry.loaded
        ]

    def _resident_commands(self) -> list[tuple[str, str, Any]]:
        models = self.service.models
        if models is None:
            return []
        commands = []
        for row in models.describe():
            alias = str(row["alias"])
            if row["default"]:
                continue
            verb = "unpin" if row["pinned"] else "pin"
            commands.append((f"model: {verb} {alias}", "Never unload it to make room or when idle" if verb == "pin"
                             else "Let it be unloaded again when the budget needs room",
                             partial(self._set_pinned, alias, verb == "pin")))
            commands.append((f"chat: new on {alias}", f"A workbench chat whose turns {alias} serves (it loads on "
                             "the first message when it is not resident)", partial(self.app.new_chat_on, alias)))
            if row["state"] == "resident":
                commands.append((f"model: unload {alias}", "Unload it now; its agents go to the warm tier and come "
                                 "back with it", partial(self._in_worker, self._unload, alias)))
            elif row["state"] in ("unloaded", "failed"):
                commands.append((f"model: load {alias}", f"Load {row['source']} now (least recently used models "
                                 "make room)", partial(self._in_worker, self._load, alias)))
        return commands

    def _set_pinned(self, alias: str, pinned: bool) -> None:
        self.service.models.set_pinned(alias, pinned)
        self.app.notify(f"Model {alias} {'pinned' if pinned else 'unpinned'}")

    def _in_worker(self, job: Any, alias: str) -> None:
        # A thread of its own, ended with its MLX streams released: a pooled worker thread that ran an
        # earlier load has had its streams cleared, and MLX then fails on it ("no Stream(cpu, 0) in current
        # thread").
        threading.Thread(target=job, args=(alias,), name=f"semantic-model-{alias}", daemon=True).start()

    def _load(self, alias: str) -> None:
        models = self.service.models
        try:
            models.engine_for(alias, request=False)
            message, severity = f"Model {alias} is resident", "information"
        except SemanticError as exc:
            message, severity = str(exc), "error"
        finally:
            release_thread_streams()  # this worker thread ends here; MLX needs its cleanup before that
        self.app.call_from_thread(self.app.notify, message, severity=severity)

    def _unload(self, alias: str) -> None:
        done = self.service.models.unload(alias, "asked in the workbench")
        release_thread_streams()
        message = f"Model {alias} unloaded" if done else f"Model {alias} is serving a turn; try again when it is idle"
        self.app.call_from_thread(self.app.notify, message, severity="information" if done else "warning")

    def pick(self) -> None:
        """The picker of the models the workbench's client can swap to (embedded: this process's registry;
        attached: the server's /v1/models), then the confirmation and the progress."""
        self.app.run_worker(self._pick(), exclusive=True, group="model-swap")

    async def _pick(self) -> None:
        try:
            entries = await self.app.client.swap_choices()
        except SemanticError as exc:
            self.app.notify(f"Model swaps: {exc}", severity="warning")
            return
        self.app.push_screen(ModelPicker(entries), lambda entry: self.confirm(entry) if entry else None)

    def confirm(self, entry: RegistryEntry) -> None:
        plan = swap_plan(entry, self.app.client.state().snapshot)
        dialog = ConfirmDialog(f"Swap to {entry.model_id}?", plan, confirm="Swap")
        self.app.push_screen(dialog, lambda ok: self.start(entry) if ok else None)

    def start(self, entry: RegistryEntry) -> None:
        self.app.run_worker(self._start(entry), exclusive=True, group="model-swap")

    async def _start(self, entry: RegistryEntry) -> None:
        try:
            watch = await self.app.client.start_swap(entry)
        except SemanticError as exc:
            self.app.notify(str(exc), severity="error")
            return
        self.app.push_screen(SwapProgressScreen(watch), self.finished)

    def finished(self, status: SwapStatus | None) -> None:
        if status is None:
            return
        if status.phase is SwapPhase.DONE:
            self.app.notify(f"Now serving {status.to_model} (swap took {status.total_seconds:.1f} s)")
        else:
            detail = f"{status.error}\n\n{status.from_model} is serving again."
            self.app.push_screen(ErrorDialog(f"Swap to {status.to_model} failed", detail))
        self.app.refresh_panes(force=True)
