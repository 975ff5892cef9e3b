"""A chat with one agent: send turns from the workbench, or watch an HTTP client's turns live."""

from __future__ import annotations

import asyncio

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.reactive import var
from textual.widgets import Input, ProgressBar, Static
from textual.worker import Worker

from typing import Callable

from engine.domain.chat import ChatMessage
from engine.errors import SemanticError
from engine.domain.requests import AgentSource, FinishEvent, FinishReason

from ..chat_events import (
    WATCH_UPDATES_PER_S,
    NORMAL_ENDINGS,
    EventFeed,
    PaneState,
    TurnBatch,
    ending_text,
    header_text,
    read_only_hint,
    request_line,
    split_batch,
    usage_line,
)
from ..chat_link import ChatLink, ChatTarget, ChatTurn
from ..chat_messages import CloseRequested, TurnFinished, TurnStarted
from ..image_attachments import user_message
from .chat_transcript import ChatTranscript, LiveReply


# A read-only pane whose link cannot watch (an attached workbench: the tokens of another client's turns stay on
# the server).
UNWATCHED = "this client's turns are not streamed to an attached workbench: the log shows when they run and end"


class ChatPane(Vertical):
    """Bound to one agent id; read-only (watching) when another client drives that agent. ``link``: how turns
    reach the engine (chat_link.py): in this process, or a server the workbench is attached to."""

    TurnStarted = TurnStarted
    TurnFinished = TurnFinished
    CloseRequested = CloseRequested

    DEFAULT_CSS = """
    ChatPane {
        width: 1fr;
        height: 1fr;
        border: round $panel-lighten-2;
        padding: 0 1;
    }
    ChatPane:focus-within { border: round $accent; }
    ChatPane > #chat-header { height: 1; }
    ChatPane > #chat-prefill { height: 1; width: 1fr; display: none; }
    ChatPane > #chat-prefill.-active { display: block; }
    ChatPane > #chat-prefill Bar { width: 1fr; }
    ChatPane.-compact { padding: 0; }
    """
    BINDINGS = [
        Binding("escape", "cancel_turn", "Stop", id="chat.cancel", tooltip="Stop generating"),
        # Priority: the focused Input binds ctrl+w to delete-word and would swallow it.
        Binding("ctrl+w", "close_pane", "Close chat", id="chat.close", tooltip="Close this chat pane",
                priority=True),
    ]

    # init=False: the watchers touch children, which exist only after compose.
    state: var[PaneState] = var(PaneState.IDLE, init=False)
    prefill: var[tuple[int, int]] = var((0, 0), init=False)
    batch_size: var[int] = var(1, init=False)
    compact: var[bool] = var(False, init=False)

    def __init__(
        self,
        link: ChatLink,
        agent_id: str,
        label: str | None = None,
        source: str = AgentSource.TUI.value,
        *,
        read_only: bool | None = None,
        max_tokens: int | None = None,
        model: str | None = None,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.link = link
        self.agent_id = agent_id
        # An extra model's alias (--extra-model): its turns are routed there by name; None: the default model.
        self.model = model
        self.label = label or agent_id
        self.source = source
        # Another client's turns are that client's conversation: sending ours would fork it.
        self.read_only = not link.drives(source) if read_only is None else read_only
        self.max_tokens = max_tokens
        self.history: list[ChatMessage] = []
        self._turn: ChatTurn | None = None
        self._unwatch: Callable[[], None] | None = None  # stops watching another client's turns
        self._observed: dict[str, LiveReply] = {}

    def compose(self) -> ComposeResult:
        yield Static(id="chat-header")
        yield ProgressBar(total=1, show_percentage=False, show_eta=False, id="chat-prefill")
        yield ChatTranscript()
        hint = read_only_hint(self.source) if self.read_only else "message (Enter to send, Esc to stop)"
        yield Input(placeholder=hint, id="chat-input", disabled=self.read_only)

    def on_mount(self) -> None:
        if self.read_only:
            self.state = PaneState.WATCHING
            self._start_watching()
        self._refresh_header()

    def on_unmount(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
        if self._turn is not None:
            self._turn.cancel()

    # -- public -------------------------------------------------------------------------------
    @property
    def transcript(self) -> ChatTranscript:
        return self.query_one(ChatTranscript)

    @property
    def input(self) -> Input:
        return self.query_one("#chat-input", Input)

    @property
    def busy(self) -> bool:
        return self.state not in (PaneState.IDLE, PaneState.WATCHING)

    def focus_input(self) -> None:
        (self.transcript if self.input.disabled else self.input).focus()

    def send(self, text: str) -> Worker[None] | None:
        """Run one turn with ``text`` as the user message; None while busy or read-only."""
        if self.busy or self.read_only:
            return None
        return self.run_worker(
            self._run_turn(text), group=f"chat-{self.agent_id}", exclusive=True,
            exit_on_error=False, description=f"chat turn of {self.agent_id}",
        )

    # -- sending a turn -----------------------------------------------------------------------
    @on(Input.Submitted, "#chat-input")
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if text and self.send(text) is not None:
            event.input.clear()

    async def _run_turn(self, text: str) -> None:
        self._set_busy(PaneState.PREPARING)
        try:
            try:
                user, attachments = await user_message(text)
            except ValueError as exc:
                await self.transcript.add_error(str(exc))
                return
            await self._turn_of(user, [a.line() for a in attachments])
        finally:
            self._turn = None
            if self.is_attached:
                self._set_busy(PaneState.IDLE)

    async def _turn_of(self, user: ChatMessage, image_lines: list[str] | None = None) -> None:
        said = "\n\n".join(p for p in user.parts if isinstance(p, str)) if user.parts else user.content
        await self.transcript.add_user(said)
        for line in image_lines or ():
            await self.transcript.add_image(line)
        try:
            self._turn = await self._start(user)
        except (SemanticError, ValueError) as exc:
            await self.transcript.add_error(str(exc))
            self.post_message(TurnFinished(self.agent_id, None, FinishReason.ERROR.value, str(exc)))
            return
        self.post_message(TurnStarted(self.agent_id, self._turn.request_id))
        reply, finish = await self._follow(self._turn)
        if finish.reason in NORMAL_ENDINGS:
            self.history += [user, ChatMessage("assistant", reply.text, reasoning=reply.reasoning)]
        await self._show_finish(finish)

    async def _start(self, user: ChatMessage) -> ChatTurn:
        target = ChatTarget(self.agent_id, self.label, self.model, self.max_tokens)
        return await self.link.start(target, tuple(self.history), user)

    async def _follow(self, turn: ChatTurn) -> tuple[LiveReply, FinishEvent]:
        feed, reply = EventFeed(), LiveReply(self.transcript)
        pumping = asyncio.create_task(turn.run(feed))
        finish: FinishEvent | None = None
        try:
            while finish is None:
                for batch in split_batch(await feed.next_batch()):
                    finish = await self._apply(batch, reply) or finish
        finally:
            # Also reached when the pane closes mid-turn: the engine must stop generating for nobody.
            turn.cancel()
            pumping.cancel()
            await reply.close(finish.usage.reasoning_tokens if finish is not None else None)
        return reply, finish

    async def _apply(self, batch: TurnBatch, reply: LiveReply) -> FinishEvent | None:
        """One screen update for a whole batch of events."""
        if batch.queued is not None and self.state is PaneState.PREPARING:
            self.state = PaneState.QUEUED
        prefill = batch.prefill
        if prefill is not None and prefill.total and not batch.text and not batch.reasoning:
            self.prefill = (prefill.done, prefill.total)
            self._set_state_unless_stopping(PaneState.PREFILLING)
        if batch.reasoning:
            self.prefill = (0, 0)
            self._set_state_unless_stopping(PaneState.THINKING)
            await reply.think(batch.reasoning, batch.reasoning_tokens)
        if batch.text:
            self.prefill = (0, 0)
            self._set_state_unless_stopping(PaneState.GENERATING)
            await reply.write(batch.text)
        return batch.finish

    async def _show_finish(self, finish: FinishEvent, observed: bool = False) -> None:
        note = ending_text(finish)
        if finish.reason is FinishReason.ERROR:
            await self.transcript.add_error(note or "error")
        else:
            if note:
                await self.transcript.add_note(note)
            await self.transcript.add_usage(usage_line(finish.usage))
        reason = finish.reason.value
        self.post_message(TurnFinished(self.agent_id, finish.usage, reason, finish.error, observed))

    # -- watching another client's turns -------------------------------------------------------
    def _start_watching(self) -> None:
        feed = EventFeed(WATCH_UPDATES_PER_S)
        self._unwatch = self.link.watch(self.agent_id, self.model, feed.threadsafe_sink(asyncio.get_running_loop()))
        if self._unwatch is None:
            self.run_worker(self.transcript.add_note(UNWATCHED), exit_on_error=False)
            return
        self.run_worker(self._observe(feed), group=f"watch-{self.agent_id}", exclusive=True,
                        exit_on_error=False, description=f"watching {self.agent_id}")

    async def _observe(self, feed: EventFeed) -> None:
        while True:
            for batch in split_batch(await feed.next_batch()):
                await self._observe_batch(batch)

    async def _observe_batch(self, batch: TurnBatch) -> None:
        reply = self._observed.get(batch.request_id)
        if reply is None:
            reply = self._observed[batch.request_id] = LiveReply(self.transcript)
            self.post_message(TurnStarted(self.agent_id, batch.request_id, observed=True))
        if batch.prefill is not None and not reply.announced:
            reply.announced = True
            await self.transcript.add_request(request_line(batch.prefill))
        await self._apply(batch, reply)
        if batch.finish is not None:
            del self._observed[batch.request_id]
            await reply.close(batch.finish.usage.reasoning_tokens)
            await self._show_finish(batch.finish, observed=True)
            self.prefill = (0, 0)
            self.state = PaneState.WATCHING

    # -- actions ------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel_turn":
            return self._turn is not None and self.state is not PaneState.STOPPING
        return True

    def action_cancel_turn(self) -> None:
        if self._turn is not None:
            self.state = PaneState.STOPPING
            self._turn.cancel()

    def action_close_pane(self) -> None:
        self.post_message(CloseRequested(self.agent_id, self.model))

    # -- state and header -------------------------------------------------------------------
    def _set_busy(self, state: PaneState) -> None:
        self.prefill = (0, 0)
        self.state = state
        if state is PaneState.PREPARING:
            # Keep the focus inside the pane, so Esc still reaches it once the Input is disabled.
            if self.input.has_focus:
                self.transcript.focus()
            self.input.disabled = True
        elif not self.read_only:
            refocus = self.transcript.has_focus
            self.input.disabled = False
            if refocus:
                self.input.focus()
        self.refresh_bindings()

    def _set_state_unless_stopping(self, state: PaneState) -> None:
        if self.state is not PaneState.STOPPING:
            self.state = state

    def watch_state(self) -> None:
        self._refresh_header()

    def watch_prefill(self, prefill: tuple[int, int]) -> None:
        done, total = prefill
        for bar in self.query("#chat-prefill").results(ProgressBar):
            bar.set_class(total > 0, "-active")
            bar.update(total=max(total, 1), progress=done)
        self._refresh_header()

    def watch_batch_size(self) -> None:
        self._refresh_header()

    def watch_compact(self, compact: bool) -> None:
        self.set_class(compact, "-compact")
        self.transcript.set_class(compact, "-compact")
        self.input.compact = compact

    def _refresh_header(self) -> None:
        # A query, not query_one: the area sets batch_size before the pane has composed.
        label = self.label if self.model is None else f"{self.label} · {self.model}"
        text = header_text(label, self.source, self.state, self.prefill, self.batch_size)
        for header in self.query("#chat-header").results(Static):
            header.update(text)
