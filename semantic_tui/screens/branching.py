"""Dialogs of the branching commands: a turn picker (rewind, fork at a turn) and a file path prompt
(export, import)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

PICKER_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{ width: 72; max-width: 95%; height: auto; max-height: 80%; border: round $primary;
                    padding: 1 2; background: $surface; }}
{name} OptionList {{ height: auto; max-height: 20; }}
"""


def turn_options(turn_ends: tuple[int, ...], cached: int) -> list[Option]:
    """One option per turn end, newest first: "turn N · T tokens", and turn 0 (an empty cache)."""
    options = [Option(f"turn {n} · {end:,} tokens" + (" (now)" if end == cached else ""), id=str(n))
               for n, end in reversed(list(enumerate(turn_ends, start=1)))]
    return options + [Option("turn 0 · empty (before the first turn)", id="0")]


class TurnPicker(ModalScreen[int | None]):
    """Pick a turn: the agent goes back to (or a fork starts at) the end of it."""

    DEFAULT_CSS = PICKER_CSS.format(name="TurnPicker")
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="dialog.cancel")]

    def __init__(self, title: str, turn_ends: tuple[int, ...], cached: int) -> None:
        super().__init__()
        self.title_text = title
        self.options = turn_options(turn_ends, cached)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"[b]{self.title_text}[/b]")
            yield OptionList(*self.options)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id or 0))


class PathPrompt(ModalScreen[str | None]):
    """A file path, for export (where to write) or import (what to read)."""

    DEFAULT_CSS = PICKER_CSS.format(name="PathPrompt")
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="dialog.cancel")]

    def __init__(self, title: str, default: str = "") -> None:
        super().__init__()
        self.title_text = title
        self.default = default

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"[b]{self.title_text}[/b]")
            yield Input(value=self.default, placeholder="path to the agent file")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)
