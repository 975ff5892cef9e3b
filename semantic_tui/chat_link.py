"""How a chat pane reaches the engine: one interface for the embedded workbench and the attached one.

A chat pane sends a turn and shows what comes back as engine events (queued,
prefill progress, tokens, the finish), batched by ``EventFeed``. Where those
events come from is the link's business: :class:`LocalChatLink` starts the
turn on the engine in this process (and can watch another client's turns on
it); the attached workbench's link (``remote_chat.py``) sends it to the
server's direct agent API and turns the reply's server-sent events back into
the same events. The pane's drawing is one code path for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from engine.api import turns
from engine.api.async_turn import AsyncTurn
from engine.api.identity import AgentIdentity
from engine.api.service import EngineService
from engine.domain.chat import ChatMessage, Conversation
from engine.domain.priority import AgentClass
from engine.domain.requests import AgentSource, EventSink

from .chat_events import EventFeed, pump


@dataclass(frozen=True, slots=True)
class ChatTarget:
    """The agent a pane talks to: its id, its label, the model it belongs to (an extra model's alias; None:
    the default model), and the most tokens a reply may have (None: the engine's default_max_tokens)."""

    agent_id: str
    label: str
    model: str | None = None
    max_tokens: int | None = None


class ChatTurn(Protocol):
    request_id: str

    async def run(self, feed: EventFeed) -> None:
        """Put the turn's events into ``feed`` until its finish event (included)."""

    def cancel(self) -> None:
        """Stop generating; the turn still ends with a finish event (cancelled)."""


class ChatLink(Protocol):
    def drives(self, source: str) -> bool:
        """Whether a pane may send turns to an agent of this source (else it only watches)."""

    async def create(self, agent_id: str, label: str) -> str:
        """Make a new agent for a new chat; the id it got (another if ``agent_id`` is taken)."""

    async def start(self, target: ChatTarget, history: tuple[ChatMessage, ...], user: ChatMessage) -> ChatTurn:
        """Send ``user`` as the next turn; raises SemanticError (or ValueError) when it cannot start."""

    def watch(self, agent_id: str, model: str | None, sink: EventSink) -> Callable[[], None] | None:
        """Send another client's turns on this agent to ``sink``; the call that stops it, or None when this
        link cannot watch at all."""


class LocalTurn:
    """A turn on the engine in this process."""

    def __init__(self, turn: AsyncTurn) -> None:
        self.turn = turn
        self.request_id = turn.request_id

    async def run(self, feed: EventFeed) -> None:
        await pump(self.turn, feed)

    def cancel(self) -> None:
        self.turn.cancel()


class LocalChatLink:
    """The embedded workbench's: turns go straight to the engine, with the history the pane keeps."""

    def __init__(self, service: EngineService) -> None:
        self.service = service

    def drives(self, source: str) -> bool:
        # Another client's turns are that client's conversation: sending ours would fork it.
        return source == AgentSource.TUI.value

    async def create(self, agent_id: str, label: str) -> str:
        return agent_id  # the first turn makes the agent

    async def start(self, target: ChatTarget, history: tuple[ChatMessage, ...], user: ChatMessage) -> ChatTurn:
        identity = AgentIdentity(target.agent_id, AgentSource.TUI, target.label, agent_class=AgentClass.INTERACTIVE)
        max_tokens = target.max_tokens or self.service.settings.default_max_tokens
        spec = turns.TurnSpec(Conversation(history + (user,)), identity, max_tokens=max_tokens, model=target.model,
                              by_operator=True)
        return LocalTurn(self.service.start_turn(await turns.prepare(self.service, spec)))

    def watch(self, agent_id: str, model: str | None, sink: EventSink) -> Callable[[], None] | None:
        engine = None
        if self.service.is_ready:
            engine = self.service.engine if model is None else dict(self.service.served_engines()).get(model)
        if engine is None:
            return lambda: None  # no engine to watch (loading, or the model unloaded): nothing will come
        engine.watch(agent_id, sink)
        return lambda: engine.unwatch(agent_id, sink)
