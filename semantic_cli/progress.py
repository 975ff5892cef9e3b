"""A Rich progress bar for model import and load (terminal commands, not the TUI)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engine.models.gguf_import import ImportProgress

STAGE_LABELS = {
    "hashing": "hashing GGUF",
    "reading": "reading GGUF",
    "tensors": "dequantizing tensors",
    "tokenizer": "building tokenizer",
    "writing": "writing MLX folder",
    "loading": "loading weights",
}


@contextmanager
def model_progress(console: Console) -> Iterator[Callable[[ImportProgress], None]]:
    progress = Progress(
        TextColumn("[bold]{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    tasks: dict[str, int] = {}

    def report(update: ImportProgress) -> None:
        if update.stage not in tasks:
            tasks[update.stage] = progress.add_task(STAGE_LABELS.get(update.stage, update.stage), total=update.total)
        progress.update(tasks[update.stage], completed=update.done, total=update.total)

    with progress:
        yield report
