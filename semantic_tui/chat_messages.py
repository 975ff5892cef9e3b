"""Typed messages of the chat panes and the area that holds them.

The pane's messages carry the ``chat_pane`` namespace so their handlers are
named as if they were nested in the widget (``on_chat_pane_turn_finished``);
the widgets re-export them as ``ChatPane.TurnFinished`` and ``ChatArea.Changed``
(handler ``on_chat_area_changed``).
"""

from __future__ import annotations

from textual.message import Message

from engine.domain.requests import Usage


class TurnStarted(Message, namespace="chat_pane"):
    """A turn of ``agent_id`` reached the engine (sent from the pane, or observed in watch mode)."""

    def __init__(self, agent_id: str, request_id: str, observed: bool = False) -> None:
        super().__init__()
        self.agent_id = agent_id
        self.request_id = request_id
        self.observed = observed


class TurnFinished(Message, namespace="chat_pane"):
    """A turn ended; ``usage`` is None when it never reached the engine (e.g. prompt too long)."""

    def __init__(
        self, agent_id: str, usage: Usage | None, reason: str,
        error: str | None = None, observed: bool = False,
    ) -> None:
        super().__init__()
        self.agent_id = agent_id
        self.usage = usage
        self.reason = reason
        self.error = error
        self.observed = observed


class CloseRequested(Message, namespace="chat_pane"):
    """The user asked to close the pane; the area that holds it decides."""

    def __init__(self, agent_id: str, model: str | None = None) -> None:
        super().__init__()
        self.agent_id = agent_id
        self.model = model


class ChatAreaChanged(Message):
    """Panes were opened or closed; ``agent_ids`` in left-to-right order."""

    def __init__(self, agent_ids: tuple[str, ...]) -> None:
        super().__init__()
        self.agent_ids = agent_ids
