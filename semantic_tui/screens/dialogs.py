"""Small modal dialogs: errors (readable, never a traceback) and confirmations."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

DIALOG_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{ width: 72; max-width: 95%; height: auto; border: round $primary; padding: 1 2; background: $surface; }}
{name} Horizontal {{ height: auto; align-horizontal: right; margin-top: 1; }}
{name} Button {{ margin-left: 1; }}
"""


class ErrorDialog(ModalScreen[str]):
    DEFAULT_CSS = DIALOG_CSS.format(name="ErrorDialog") + "ErrorDialog > Vertical { border: round $error; }"
    BINDINGS = [Binding("escape", "dismiss('close')", "Close", id="dialog.close")]

    def __init__(self, title: str, detail: str, actions: tuple[str, ...] = ("close",)) -> None:
        super().__init__()
        self.title_text = title
        self.detail = detail
        self.actions = actions

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"[b]{self.title_text}[/b]")
            yield Static(self.detail, markup=False)
            with Horizontal():
                for action in self.actions:
                    yield Button(action.capitalize(), id=action, variant="error" if action == "quit" else "default")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "close")


class ConfirmDialog(ModalScreen[bool]):
    DEFAULT_CSS = DIALOG_CSS.format(name="ConfirmDialog")
    BINDINGS = [
        Binding("escape", "dismiss(False)", "Cancel", id="dialog.cancel"),
        Binding("enter", "dismiss(True)", "Confirm", id="dialog.confirm"),
    ]

    def __init__(self, title: str, body: str, confirm: str = "Confirm") -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.confirm = confirm

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"[b]{self.title_text}[/b]")
            yield Static(self.body, markup=False)
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button(self.confirm, id="confirm", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#confirm", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")
