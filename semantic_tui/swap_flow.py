"""The workbench side of a model swap: pick, confirm what will be spilled, follow progress."""

from __future__ import annotations

from functools import partial
from typing import Any

from engine.errors import SemanticError
from engine.models.registry import RegistryEntry
from engine.swap import SwapPhase, SwapStatus

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
        """``model: swap to X`` for every registry model that is not loaded."""
        if self.service.swapper is None:
            return []
        return [
            (f"model: swap to {entry.model_id}", describe(entry), partial(self.confirm, entry))
            for entry in self.service.registry.entries()
            if not entry.loaded
        ]

    def pick(self) -> None:
        if self.service.swapper is None:
            shard = self.service.engine.loaded.shard if self.service.is_ready else None
            if shard is not None:
                self.app.notify(f"Model swaps are not available while the model is sharded across {shard[1]} "
                                "ranks: restart the ranks with the other model", severity="warning")
            else:
                self.app.notify("Model swaps start once the first model has loaded", severity="warning")
            return
        entries = self.service.registry.entries()
        self.app.push_screen(ModelPicker(entries), lambda entry: self.confirm(entry) if entry else None)

    def confirm(self, entry: RegistryEntry) -> None:
        plan = swap_plan(entry, self.service.snapshot())
        dialog = ConfirmDialog(f"Swap to {entry.model_id}?", plan, confirm="Swap")
        self.app.push_screen(dialog, lambda ok: self.start(entry) if ok else None)

    def start(self, entry: RegistryEntry) -> None:
        swapper = self.service.swapper
        try:
            swapper.request(entry.location, self.app.backend.settings.swap_grace_s)
        except SemanticError as exc:
            self.app.notify(str(exc), severity="error")
            return
        self.app.push_screen(SwapProgressScreen(swapper), self.finished)

    def finished(self, status: SwapStatus | None) -> None:
        if status is None:
            return
        if status.phase is SwapPhase.DONE:
            self.app.notify(f"Now serving {status.to_model} (swap took {status.total_seconds:.1f} s)")
        else:
            detail = f"{status.error}\n\n{status.from_model} is serving again."
            self.app.push_screen(ErrorDialog(f"Swap to {status.to_model} failed", detail))
        self.app.refresh_panes(force=True)
