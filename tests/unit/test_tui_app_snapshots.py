"""Screenshots of the whole workbench at 80x24 and 160x48 (pytest-textual-snapshot).

Everything on screen is made deterministic: a scripted engine, fixed agent
timestamps, no wall clock in the log, and a fixed HTTP address.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
from textual.widgets import Input

from engine.domain.requests import AgentSource, FinishEvent, GenerationRequest
from semantic_tui.backend import ListenerInfo, WorkbenchBackend
from semantic_tui.widgets.agents_table import AgentsTable
from semantic_tui.widgets.event_log import EventLogView
from tests.support.scripted_engine import ScriptedEngine
from tests.support.workbench import workbench

FIXED_NOW = 1_800_000_000.0


class FixedAddressBackend(WorkbenchBackend):
    async def start_http(self) -> ListenerInfo:
        self.listener = ListenerInfo("127.0.0.1", 8642)
        return self.listener

    async def stop_http(self) -> None:
        return None


def populated_engine() -> ScriptedEngine:
    engine = ScriptedEngine(lambda r: "Sure. Here is **a short answer** with `code`.")
    agents = [("cc-7f3a", AgentSource.CLAUDE_CODE, "Claude Code 7f3a9c1e", 900),
              ("oa-review", AgentSource.OPENAI, "OpenAI session review", 500),
              ("api-writer", AgentSource.API, None, 300)]
    for agent_id, source, name, size in agents:  # one at a time: block allocation order is fixed
        done = threading.Event()
        engine.submit(GenerationRequest(agent_id, tuple(b"q" * size), 16, source=source, display_name=name),
                      lambda e, done=done: done.set() if isinstance(e, FinishEvent) else None)
        done.wait(10)
    for i, agent in enumerate(engine.agents.values()):
        agent.created_at = agent.last_used = FIXED_NOW - 10 * (i + 1)
    return engine


def make_app(tmp_path: Path):
    app = workbench(tmp_path, populated_engine())
    app.backend.__class__ = FixedAddressBackend
    return app


async def settle(pilot, open_chat: bool) -> None:
    app = pilot.app
    while not app.backend.service.is_ready or app.backend.listener is None:
        await pilot.pause(0.05)
    app.query_one(AgentsTable).now = lambda: FIXED_NOW
    log = app.query_one(EventLogView)
    log.show_clock = False
    log.clear()
    log._seen = 10**9  # start empty: event wording is tested elsewhere
    if open_chat:
        await pilot.press("n")
        await pilot.press(*"hello", "enter")
        while len(app.query("ChatPane").first().history) < 2:
            await pilot.pause(0.05)
        app.backend.engine.agents["chat-1"].created_at = app.backend.engine.agents["chat-1"].last_used = FIXED_NOW - 5
    for field in app.query(Input):
        field.cursor_blink = False
    app.refresh_panes(force=True)
    await pilot.pause(0.3)
    app.refresh_panes(force=True)
    await pilot.pause(0.1)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
@pytest.mark.parametrize("chats", [False, True], ids=["dashboard", "chat-open"])
def test_main_screen(snap_compare, tmp_path: Path, size: tuple[int, int], chats: bool) -> None:
    assert snap_compare(make_app(tmp_path), terminal_size=size, run_before=lambda pilot: settle(pilot, chats))


SYSTEM = "You are a coding agent.\nToday's date is {date}.\nUse the tools when needed.\n"


def test_cache_history_screen(snap_compare, tmp_path: Path) -> None:
    """`i` on an agent whose second turn's system prompt changed only in its date line."""
    engine = populated_engine()
    for date in ("2026-11-25", "2026-11-26"):
        done = threading.Event()
        prompt = tuple((SYSTEM.format(date=date) + "user: list the files\n").encode())
        engine.submit(GenerationRequest("cc-7f3a", prompt, 16, source=AgentSource.CLAUDE_CODE,
                                        display_name="Claude Code 7f3a9c1e", head_tokens=len(SYSTEM)),
                      lambda e, done=done: done.set() if isinstance(e, FinishEvent) else None)
        done.wait(10)
    agent = engine.agents["cc-7f3a"]
    agent.history = [replace(turn, at=FIXED_NOW - 60 * (len(agent.history) - i)) for i, turn in enumerate(agent.history)]
    app = workbench(tmp_path, engine)
    app.backend.__class__ = FixedAddressBackend

    async def open_history(pilot) -> None:
        await settle(pilot, open_chat=False)
        table = app.query_one(AgentsTable)
        table.focus()
        table.move_cursor(row=table.get_row_index("cc-7f3a"))
        app.clear_notifications()
        await pilot.press("i")
        screen = app.screen
        screen.now = lambda: FIXED_NOW
        screen._shown = None
        screen.refresh_history()
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(120, 36), run_before=open_history)


async def settle_attached(pilot) -> None:
    """The attached workbench once its stream has brought the server's three agents."""
    app = pilot.app
    while app.client.state().snapshot is None or len(app.client.state().snapshot.agents) < 3:
        await pilot.pause(0.05)
    app.query_one(AgentsTable).now = lambda: FIXED_NOW
    log = app.query_one(EventLogView)
    log.show_clock = False
    log.clear()
    log._seen = 10**9
    app.refresh_panes(force=True)
    await pilot.pause(0.3)
    app.refresh_panes(force=True)
    await pilot.pause(0.1)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_attached_main_screen(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:
    """`semantic attach` on a server with the same three agents: the same panes, drawn from its /v1/stream."""
    from semantic_tui.app import SemanticApp
    from semantic_tui.preferences import load_preferences
    from semantic_tui.remote_client import RemoteClient
    from tests.support.router_app import LiveServer, build_app, make_service

    with LiveServer(build_app(make_service(tmp_path / "cache", populated_engine()))) as live:
        client = RemoteClient(live.url, interval_s=0.1)
        client.address = "http://127.0.0.1:8642"  # shown on the top line; the server's port is ephemeral
        app = SemanticApp(client, load_preferences(tmp_path / "workbench.json"), poll_interval_s=0.1)
        assert snap_compare(app, terminal_size=size, run_before=settle_attached)
