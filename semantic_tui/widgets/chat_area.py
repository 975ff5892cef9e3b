"""Up to four chat panes side by side; the engine batches their turns together."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.events import Resize
from textual.widgets import Static

from engine.domain.requests import AgentSource

from ..chat_link import ChatLink
from ..chat_messages import ChatAreaChanged, CloseRequested
from .chat_pane import ChatPane

# Below this many columns per pane, padding and borders cost more than they help.
COMPACT_BELOW_COLUMNS = 40


class ChatArea(Horizontal):
    """Equal-width panes, one per agent; opening an agent that has a pane focuses it."""

    Changed = ChatAreaChanged
    MAX_PANES = 4

    DEFAULT_CSS = """
    ChatArea { width: 1fr; height: 1fr; }
    ChatArea > ChatPane { width: 1fr; }
    ChatArea > #chat-empty {
        width: 1fr;
        height: 1fr;
        content-align: center middle;
        color: $text-muted;
    }
    """

    def __init__(self, link: ChatLink, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.link = link
        self.batch_size = 1

    def compose(self) -> ComposeResult:
        yield Static("No chats open. Open one from the agents table.", id="chat-empty")

    # -- queries ------------------------------------------------------------------------------
    @property
    def panes(self) -> list[ChatPane]:
        return list(self.query_children(ChatPane))

    @property
    def pane_count(self) -> int:
        return len(self.panes)

    def pane_for(self, agent_id: str, model: str | None = None) -> ChatPane | None:
        """The pane of ``agent_id`` of the model ``model`` (an extra model's alias; None: the default's)."""
        return next((pane for pane in self.panes if pane.agent_id == agent_id and pane.model == model), None)

    # -- opening and closing ------------------------------------------------------------------
    async def open_chat(
        self, agent_id: str, label: str | None = None, source: str = AgentSource.TUI.value,
        read_only: bool | None = None, model: str | None = None,
    ) -> ChatPane | None:
        """Open (or focus) the pane of ``agent_id``; None when four panes are already open.

        ``read_only`` defaults to "driven by another client" (a source the link does not drive); ``model``:
        the extra model the agent belongs to (None: the default model).
        """
        existing = self.pane_for(agent_id, model)
        if existing is not None:
            existing.focus_input()
            return existing
        if self.pane_count >= self.MAX_PANES:
            self.notify(f"At most {self.MAX_PANES} chats side by side: close one first (ctrl+w).",
                        title="Chats", severity="warning")
            return None
        pane = ChatPane(self.link, agent_id, label, source, read_only=read_only, model=model)
        pane.batch_size = self.batch_size
        await self.mount(pane)
        self._relayout()
        pane.focus_input()
        self._changed()
        return pane

    async def close_chat(self, agent_id: str, model: str | None = None) -> bool:
        pane = self.pane_for(agent_id, model)
        if pane is None:
            return False
        neighbours = [p for p in self.panes if p is not pane]
        had_focus = pane.has_focus_within
        await pane.remove()
        self._relayout()
        if had_focus and neighbours:
            neighbours[-1].focus_input()
        self._changed()
        return True

    def focus_next_pane(self) -> ChatPane | None:
        """Move the focus to the pane right of the focused one, wrapping around."""
        panes = self.panes
        if not panes:
            return None
        current = next((i for i, pane in enumerate(panes) if pane.has_focus_within), -1)
        target = panes[(current + 1) % len(panes)]
        target.focus_input()
        return target

    def set_batch_size(self, batch_size: int) -> None:
        """The engine's current batch size (from its snapshot), shown by every generating pane."""
        self.batch_size = batch_size
        for pane in self.panes:
            pane.batch_size = batch_size

    # -- events -------------------------------------------------------------------------------
    @on(CloseRequested)
    async def _close_requested(self, event: CloseRequested) -> None:
        event.stop()
        await self.close_chat(event.agent_id, event.model)

    def on_resize(self, event: Resize) -> None:
        self._relayout()

    def _relayout(self) -> None:
        panes = self.panes
        self.query_one("#chat-empty").display = not panes
        compact = bool(panes) and (
            len(panes) > 2 or self.size.width // len(panes) < COMPACT_BELOW_COLUMNS
        )
        for pane in panes:
            pane.compact = compact

    def _changed(self) -> None:
        self.post_message(ChatAreaChanged(tuple(pane.agent_id for pane in self.panes)))
