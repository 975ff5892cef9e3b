"""Choosing a model to swap to, confirming what the swap will spill, and following its progress."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList, ProgressBar
from textual.widgets.option_list import Option

from engine.models.registry import RegistryEntry
from engine.runtime.engine_thread.snapshot import EngineSnapshot
from engine.swap import SwapPhase, SwapStatus

from ..formatting import human_bytes

# Rough rates for the estimate shown before a swap (a 2-core CPU box; Macs are faster).
SPILL_BYTES_PER_S = 800e6
LOAD_BYTES_PER_S = 400e6
IMPORT_S = 15.0
PHASES = ("draining", "spilling", "unloading", "loading", "rebuilding")


def describe(entry: RegistryEntry) -> str:
    bits = [entry.model_id, entry.kind]
    if entry.architecture:
        bits.append(entry.architecture)
    if entry.size_bytes:
        bits.append(human_bytes(entry.size_bytes))
    if not entry.present:
        bits.append("not installed")
    if entry.loaded:
        bits.append("loaded")
    return " · ".join(bits)


def swap_plan(entry: RegistryEntry, snapshot: EngineSnapshot | None) -> str:
    """What a swap to ``entry`` will do, for the confirmation dialog."""
    hot = [a for a in snapshot.agents if a.tier == "hot"] if snapshot else []
    spill_bytes = sum(a.bytes for a in hot)
    busy = sum(a.state != "idle" for a in snapshot.agents) if snapshot else 0
    load_s = (entry.size_bytes or 0) / LOAD_BYTES_PER_S + (0 if entry.size_bytes else IMPORT_S)
    estimate = spill_bytes / SPILL_BYTES_PER_S + load_s
    lines = [
        f"Spill {len(hot)} hot agents ({human_bytes(spill_bytes)}) to the warm tier; they come back when you swap back.",
        f"Running turns: {busy} (they get the swap grace period, then are cancelled).",
        f"Load {entry.model_id}" + ("" if entry.size_bytes else " (imported on first use)") + ".",
        f"Estimated time: about {estimate:.0f} s.",
    ]
    return "\n".join(lines)


class ModelPicker(ModalScreen[RegistryEntry | None]):
    DEFAULT_CSS = """
    ModelPicker { align: center middle; }
    ModelPicker > Vertical { width: 80; max-width: 95%; height: auto; max-height: 80%; border: round $primary;
                             padding: 1 2; background: $surface; }
    ModelPicker OptionList { height: auto; max-height: 20; }
    """
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="picker.cancel")]

    def __init__(self, entries: list[RegistryEntry]) -> None:
        super().__init__()
        self.entries = entries

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("[b]Swap model[/b]  (enter to choose, esc to cancel)")
            yield OptionList(*[Option(describe(e), id=str(i), disabled=e.loaded) for i, e in enumerate(self.entries)])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.entries[int(event.option.id or 0)])


class SwapProgressScreen(ModalScreen[SwapStatus]):
    """Phase bars for drain, spill, unload, load (with import stages), rebuild."""

    DEFAULT_CSS = """
    SwapProgressScreen { align: center middle; }
    SwapProgressScreen > Vertical { width: 70; height: auto; border: round $primary; padding: 1 2; background: $surface; }
    SwapProgressScreen ProgressBar { width: 100%; }
    """

    def __init__(self, swapper, poll_s: float = 0.2) -> None:
        super().__init__()
        self.swapper = swapper
        self.poll_s = poll_s
        self._swap_seen_done = False

    def compose(self) -> ComposeResult:
        status = self.swapper.status
        with Vertical():
            yield Label(f"[b]Swapping {status.from_model} → {status.to_model}[/b]", id="swap-title")
            for phase in PHASES:
                yield Label(phase, id=f"label-{phase}")
                yield ProgressBar(total=1, show_eta=False, id=f"bar-{phase}")
            yield Label("", id="swap-detail")

    def on_mount(self) -> None:
        self._poll_timer = self.set_interval(self.poll_s, self._poll)

    def _poll(self) -> None:
        # Dismissing pops the screen asynchronously: a tick that lands before the screen is gone
        # must not dismiss it a second time (that pops the screen below it, or raises).
        if self._swap_seen_done:
            return
        status = self.swapper.status
        for phase in PHASES:
            bar = self.query_one(f"#bar-{phase}", ProgressBar)
            if phase in status.seconds:
                bar.update(total=1, progress=1)
                self.query_one(f"#label-{phase}", Label).update(f"{phase}  {status.seconds[phase]:.1f} s")
            elif phase == "loading" and status.phase is SwapPhase.LOADING and status.load_total:
                bar.update(total=status.load_total, progress=status.load_done)
                self.query_one(f"#label-{phase}", Label).update(f"loading  ({status.load_stage})")
        if status.phase is SwapPhase.ROLLING_BACK:
            self.query_one("#swap-detail", Label).update(f"[red]failed: {status.error}; reloading {status.from_model}[/red]")
        if not status.running:
            self._swap_seen_done = True
            self._poll_timer.stop()
            self.dismiss(status)
