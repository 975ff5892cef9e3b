"""Model import and load progress: one bar per stage, real counts, not a spinner alone."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, ProgressBar

from engine.models.gguf_import import ImportProgress

STAGES = {
    "hashing": "Hashing the GGUF file",
    "reading": "Reading the GGUF file",
    "tensors": "Dequantizing tensors",
    "tokenizer": "Building the tokenizer",
    "writing": "Writing the MLX model folder",
    "loading": "Loading weights",
    "compiling": "Loading the CPU's compiled loops (the first start after an install compiles them)",
}


class LoadingScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    LoadingScreen { align: center middle; }
    LoadingScreen > Vertical { width: 64; height: auto; border: round $primary; padding: 1 2; background: $surface; }
    LoadingScreen Label { margin-top: 1; }
    LoadingScreen ProgressBar { width: 100%; }
    """

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model
        self._bars: dict[str, ProgressBar] = {}

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Label(f"[b]Loading {self.model}[/b]")
            yield Label("First use imports the model into an MLX folder; later starts skip that.", classes="hint")

    def update_progress(self, progress: ImportProgress) -> None:
        bar = self._bars.get(progress.stage)
        if bar is None:
            box = self.query_one("#loading-box", Vertical)
            box.mount(Label(STAGES.get(progress.stage, progress.stage)))
            bar = ProgressBar(total=max(progress.total, 1), show_eta=False, id=f"stage-{progress.stage}")
            box.mount(bar)
            self._bars[progress.stage] = bar
        bar.update(total=max(progress.total, 1), progress=progress.done)
