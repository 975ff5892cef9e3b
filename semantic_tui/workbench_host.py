"""What the palette and the flows (branch_flow.py, swap_flow.py) use of the workbench app.

The app (app.py) builds them and is this; they see only this side of it, so
none of them imports the app that imports them.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from textual.screen import Screen

from .backend import WorkbenchBackend
from .workbench_client import WorkbenchClient


class WorkbenchHost(Protocol):
    backend: WorkbenchBackend | None  # None in an attached workbench, whose flows are not offered yet

    @property
    def main(self) -> Screen:
        """The dashboard screen, whatever modal is on top of it."""

    client: WorkbenchClient

    def selected_row(self) -> tuple[str | None, str] | None:
        """(the extra model's alias or None, the agent id) of the selected row; None when none is."""

    def selected_agent(self) -> str | None:
        """The agent selected in the agents table."""

    def new_chat_on(self, model: str | None) -> None:
        """Open a new workbench chat whose turns ``model`` serves (an extra model's alias; None: the default)."""

    def selected_agent_label(self) -> str | None:
        """Its label as the table shows it."""

    def show_chats(self) -> None:
        """Switch the bottom area to the chats."""

    def refresh_panes(self, force: bool = False) -> None:
        """Redraw the panes from a fresh snapshot."""

    def theme_choices(self) -> list[str]:
        """The themes the palette offers."""

    def set_theme(self, name: str) -> None:
        """Switch theme (remembered)."""

    def model_commands(self) -> list[tuple[str, str, Any]]:
        """The palette's model commands (swap_flow.py)."""

    # Textual's App methods the flows call.
    def notify(self, message: str, *, title: str = "", severity: Any = "information",
               timeout: float | None = None, markup: bool = True) -> None: ...

    def push_screen(self, screen: Any, callback: Callable[[Any], Any] | None = None, *args: Any,
                    **kwargs: Any) -> Any: ...

    def run_worker(self, work: Any, *args: Any, **kwargs: Any) -> Any: ...

    def call_from_thread(self, callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

    async def run_action(self, action: Any, *args: Any, **kwargs: Any) -> bool: ...
