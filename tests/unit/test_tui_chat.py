"""The side-by-side chat panes against the scripted engine, driven through Pilot."""

from __future__ import annotations

import time

import asyncio
from typing import Callable

import pytest
from textual.app import App, ComposeResult
from textual.message import Message
from textual.pilot import Pilot
from textual.widgets import Markdown, Static

from engine.api.service import EngineService
from engine.domain.requests import (
    AgentSource,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PrefillEvent,
    QueuedEvent,
    TokenEvent,
    Usage,
)
from engine.settings import Settings
from semantic_tui.chat_link import LocalChatLink
from semantic_tui.chat_messages import ChatAreaChanged, TurnFinished, TurnStarted
from semantic_tui.widgets.chat_area import ChatArea
from semantic_tui.chat_events import EventFeed, PaneState, request_line, split_batch
from semantic_tui.widgets.chat_pane import ChatPane
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded

REPLY = "**bold** reply"


class ChatTestApp(App):
    """Just the chat area, with the chat messages recorded as the app would log them."""

    def __init__(self, engine: ScriptedEngine) -> None:
        super().__init__()
        self.engine = engine
        self.service = EngineService(Settings(), engine)
        self.seen: list[Message] = []

    def compose(self) -> ComposeResult:
        yield ChatArea(LocalChatLink(self.service))

    @property
    def area(self) -> ChatArea:
        return self.query_one(ChatArea)

    def on_chat_pane_turn_started(self, message: TurnStarted) -> None:
        self.seen.append(message)

    def on_chat_pane_turn_finished(self, message: TurnFinished) -> None:
        self.seen.append(message)

    def on_chat_area_changed(self, message: ChatAreaChanged) -> None:
        self.seen.append(message)

    def finished(self) -> list[TurnFinished]:
        return [m for m in self.seen if isinstance(m, TurnFinished)]


async def wait_until(pilot: Pilot, condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll on the app's loop; generous because CI machines run other suites beside this one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached in time")


async def say(pilot: Pilot, pane: ChatPane, text: str) -> None:
    """Fill the pane's Input and press Enter (typing key by key only makes the tests slow)."""
    pane.input.focus()
    pane.input.value = text
    await pilot.press("enter")


def texts(pane: ChatPane, css: str) -> list[str]:
    return [str(widget.render()) for widget in pane.transcript.query(css).results(Static)]


def replies(pane: ChatPane) -> list[str]:
    return [md.source for md in pane.transcript.query(".chat-assistant").results(Markdown)]


def chat_app(script: Callable[[GenerationRequest], str] = lambda r: REPLY, **engine_options) -> ChatTestApp:
    engine_options.setdefault("token_delay_s", 0.002)
    return ChatTestApp(ScriptedEngine(script, **engine_options))


async def test_a_turn_streams_the_reply_and_shows_its_usage() -> None:
    app = chat_app()
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await app.area.open_chat("a1", "Agent one")
        await say(pilot, pane, "hello")
        await wait_until(pilot, lambda: bool(app.finished()))
        await pilot.pause()
        assert replies(pane) == [REPLY]
        assert [m.source for m in pane.transcript.query(".chat-user").results(Markdown)] == ["hello"]
        usage = texts(pane, ".chat-usage")
        assert len(usage) == 1 and f"generated {len(REPLY)}" in usage[0] and "100.0 tok/s" in usage[0]
        assert [(m.role, m.content) for m in pane.history] == [("user", "hello"), ("assistant", REPLY)]
        assert pane.state is PaneState.IDLE and not pane.input.disabled and pane.input.value == ""
        assert [type(m) for m in app.seen][-2:] == [TurnStarted, TurnFinished]
        assert app.finished()[-1].usage.generated_tokens == len(REPLY)
        request = app.engine.requests[-1]
        assert request.source is AgentSource.TUI and request.display_name == "Agent one"


async def test_the_second_turn_reuses_the_first_turns_cache() -> None:
    app = chat_app()
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await app.area.open_chat("a1", "Agent one")
        await say(pilot, pane, "first")
        await wait_until(pilot, lambda: len(pane.history) == 2)
        await say(pilot, pane, "second")
        await wait_until(pilot, lambda: len(app.finished()) == 2)
        first, second = app.finished()
        assert first.usage.reused_tokens == 0
        assert second.usage.reused_tokens > 0
        assert f"reused {second.usage.reused_tokens:,}" in texts(pane, ".chat-usage")[-1]
        first_prompt, second_prompt = (r.prompt_tokens for r in app.engine.requests)
        assert second_prompt[: len(first_prompt)] == first_prompt


async def test_prefill_progress_shows_in_the_header_and_a_thin_bar() -> None:
    app = chat_app(prefill_delay_s=0.5)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await app.area.open_chat("a1", "Agent one")
        await say(pilot, pane, "hello")
        await wait_until(pilot, lambda: pane.state is PaneState.PREFILLING)
        prompt = len(app.engine.requests[-1].prompt_tokens)
        header = str(pane.query_one("#chat-header", Static).render())
        assert header == f"Agent one · prefilling 0/{prompt} · tui"
        assert pane.query_one("#chat-prefill").has_class("-active")
        await wait_until(pilot, lambda: bool(app.finished()))
        assert not pane.query_one("#chat-prefill").has_class("-active")


async def test_two_panes_generate_at_once_and_show_the_shared_batch() -> None:
    # Long replies so both panes are surely generating at the same time, even on a loaded machine.
    app = chat_app(lambda r: "x" * 900, token_delay_s=0.005)
    async with app.run_test(size=(120, 40)) as pilot:
        left = await app.area.open_chat("left", "Left")
        right = await app.area.open_chat("right", "Right")
        app.area.set_batch_size(2)
        await say(pilot, left, "go")
        await say(pilot, right, "go")
        await wait_until(pilot, lambda: left.state is right.state is PaneState.GENERATING)
        header = str(left.query_one("#chat-header", Static).render())
        assert "generating · batch 2" in header
        await wait_until(pilot, lambda: len(left.history) == len(right.history) == 2)
        assert replies(left) == replies(right) == ["x" * 900]
        assert {r.agent_id for r in app.engine.requests} == {"left", "right"}


async def test_escape_stops_a_slow_turn_and_keeps_it_out_of_the_history() -> None:
    app = chat_app(lambda r: "slow " * 200, token_delay_s=0.01)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await app.area.open_chat("a1")
        await say(pilot, pane, "hello")
        await wait_until(pilot, lambda: pane.state is PaneState.GENERATING)
        await pilot.press("escape")
        await wait_until(pilot, lambda: pane.state is PaneState.IDLE)
        # The pane turns idle before its TurnFinished has bubbled up to the app: wait for both.
        await wait_until(pilot, lambda: bool(app.finished()))
        assert app.engine.requests[-1].request_id in app.engine.cancelled
        assert app.finished()[-1].reason == FinishReason.CANCELLED.value
        assert texts(pane, ".chat-note") == ["stopped"]
        assert pane.history == [] and not pane.input.disabled
        assert 0 < len(replies(pane)[0]) < len("slow " * 200)


async def test_a_prompt_too_long_is_shown_inline() -> None:
    app = chat_app(loaded=scripted_loaded(context=64))
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await app.area.open_chat("a1")
        await say(pilot, pane, "a message far too long for a sixty-four token context window, surely")
        await wait_until(pilot, lambda: bool(app.finished()))
        await pilot.pause()
        errors = texts(pane, ".chat-error")
        assert len(errors) == 1 and "prompt is too long" in errors[0] and "64 maximum" in errors[0]
        assert app.engine.requests == [] and pane.history == [] and replies(pane) == []
        assert app.finished()[-1].usage is None and not pane.input.disabled


async def test_an_engine_error_is_shown_inline() -> None:
    app = chat_app(fail_with="KV pool exhausted")
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await app.area.open_chat("a1")
        await say(pilot, pane, "hello")
        await wait_until(pilot, lambda: bool(app.finished()))
        await pilot.pause()
        assert texts(pane, ".chat-error") == ["error: KV pool exhausted"]
        assert pane.history == [] and texts(pane, ".chat-usage") == []


async def test_watch_mode_shows_an_http_clients_turn_read_only() -> None:
    app = chat_app(lambda r: "from claude", token_delay_s=0.001)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await app.area.open_chat("cc-1", "Claude Code 1234", AgentSource.CLAUDE_CODE.value)
        assert pane.read_only and pane.input.disabled
        assert pane.input.placeholder == "read-only: driven by Claude Code"
        assert app.engine.watchers["cc-1"]
        prompt = tuple(b"system and user text")
        request = GenerationRequest("cc-1", prompt, 64, source=AgentSource.CLAUDE_CODE)
        app.engine.submit(request, lambda event: None)  # as the HTTP layer would
        await wait_until(pilot, lambda: bool(texts(pane, ".chat-usage")))
        await pilot.pause()
        assert texts(pane, ".chat-request") == [f"⟵ request: {len(prompt)} prompt tokens, 0 reused"]
        assert replies(pane) == ["from claude"]
        assert app.finished()[-1].observed and pane.state is PaneState.WATCHING
        assert pane.history == []
        await app.area.close_chat("cc-1")
        assert app.engine.watchers["cc-1"] == []


async def test_tokens_never_become_one_textual_message_each() -> None:
    app = chat_app(lambda r: "word " * 200, token_delay_s=0.001)
    pane_messages: dict[int, Message] = {}  # by identity: a bubbling message is dispatched at every level

    def hook(message: Message) -> None:
        sender = getattr(message, "_sender", None)
        if any(isinstance(node, ChatPane) for node in getattr(sender, "ancestors_with_self", ())):
            pane_messages[id(message)] = message

    async with app.run_test(size=(120, 40), message_hook=hook) as pilot:
        pane = await app.area.open_chat("a1")
        await say(pilot, pane, "go")
        await wait_until(pilot, lambda: bool(app.finished()))
        tokens = app.finished()[-1].usage.generated_tokens
        assert tokens == 1000
        # Counted: every message from the pane's subtree, focus moves and Input changes included.
        assert len(pane_messages) < tokens / 4, f"{len(pane_messages)} pane messages for {tokens} tokens"


async def test_the_feed_hands_out_all_queued_events_and_paces_its_batches() -> None:
    feed = EventFeed(max_rate=20)  # batches at least 50 ms apart
    for i in range(50):
        feed.put(TokenEvent("req", i, "x"))
    assert len(await feed.next_batch()) == 50
    loop = asyncio.get_running_loop()
    feed.put(TokenEvent("req", 50, "y"))
    loop.call_later(0.02, feed.put, TokenEvent("req", 51, "z"))
    started = loop.time()
    second = await feed.next_batch()
    assert [e.text for e in second] == ["y", "z"] and loop.time() - started >= 0.04


def test_a_batch_is_split_where_the_next_request_begins() -> None:
    usage = Usage(3, 0, 3, 2)
    events = [
        TokenEvent("r1", 1, "a"), TokenEvent("r1", 2, "b"), FinishEvent("r1", FinishReason.STOP, usage),
        QueuedEvent("r2", 1), PrefillEvent("r2", 0, 5, 3), TokenEvent("r2", 3, "c"),
    ]
    first, second = split_batch(events)
    assert (first.request_id, first.text, first.finish.reason) == ("r1", "ab", FinishReason.STOP)
    assert (second.request_id, second.text, second.prefill.reused, second.finish) == ("r2", "c", 3, None)
    assert request_line(second.prefill) == "⟵ request: 8 prompt tokens, 3 reused"


async def test_the_area_opens_focuses_refuses_and_closes_panes() -> None:
    app = chat_app()
    async with app.run_test(size=(120, 40)) as pilot:
        area = app.area
        first = await area.open_chat("a1")
        assert await area.open_chat("a1") is first and area.pane_count == 1
        for n in range(2, 5):
            await area.open_chat(f"a{n}")
        assert area.pane_count == 4 and all(p.compact for p in area.panes)
        assert await area.open_chat("a5") is None
        await pilot.pause()
        assert any("At most 4 chats" in n.message for n in app._notifications)
        assert area.focus_next_pane() is first
        await pilot.pause()
        assert first.has_focus_within
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: area.pane_count == 3)
        assert area.pane_for("a1") is None
        changes = [m.agent_ids for m in app.seen if isinstance(m, ChatAreaChanged)]
        assert changes[-1] == ("a2", "a3", "a4") and len(changes) == 5


async def test_closing_a_pane_mid_turn_cancels_the_turn() -> None:
    app = chat_app(lambda r: "slow " * 200, token_delay_s=0.01)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await app.area.open_chat("a1")
        await say(pilot, pane, "hello")
        await wait_until(pilot, lambda: pane.state is PaneState.GENERATING)
        await app.area.close_chat("a1")
        await pilot.pause(0.05)
        assert app.engine.requests[-1].request_id in app.engine.cancelled
        assert app.area.pane_count == 0 and app.area.query_one("#chat-empty").display


@pytest.mark.parametrize("source, read_only", [("tui", False), ("openai", True), ("api", True)])
async def test_read_only_follows_the_agents_source(source: str, read_only: bool) -> None:
    app = chat_app()
    async with app.run_test(size=(120, 40)):
        pane = await app.area.open_chat("a1", source=source)
        assert pane.read_only is read_only and pane.input.disabled is read_only


async def test_a_thinking_models_reasoning_is_folded_dimmed_and_counted_and_goes_back_to_the_template() -> None:
    from semantic_tui.widgets.reasoning_fold import ReasoningFold
    from tests.support.marker_tokenizer import MarkerTokenizer

    reasoning = "Plan: greet back."
    app = chat_app(lambda r: f"{reasoning}</think>{REPLY}", loaded=scripted_loaded(tokenizer=MarkerTokenizer()))
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await app.area.open_chat("t1", "Thinker")
        await say(pilot, pane, "hello")
        await wait_until(pilot, lambda: bool(app.finished()))
        await pilot.pause()
        fold = pane.transcript.query_one(ReasoningFold)
        assert fold.collapsed and fold.text == reasoning
        assert fold.title == f"thought · {len(reasoning)} tokens"  # the usage's exact count
        assert replies(pane) == [REPLY]  # the answer alone, no marker
        assert f"thinking {len(reasoning)}" in texts(pane, ".chat-usage")[-1]
        assert pane.history[-1].reasoning == reasoning and pane.history[-1].content == REPLY
        await say(pilot, pane, "again")
        await wait_until(pilot, lambda: len(app.finished()) == 2)
        prompt = app.engine.loaded.tokenizer.decode(list(app.engine.requests[-1].prompt_tokens))
        assert f"<think>{reasoning}</think>{REPLY}" in prompt
