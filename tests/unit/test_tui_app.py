"""The whole workbench driven with Pilot against the scripted engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from engine.domain.requests import AgentSource, GenerationRequest
from semantic_tui.widgets.agents_table import AgentsTable
from semantic_tui.widgets.chat_area import ChatArea
from semantic_tui.widgets.chat_transcript import ChatTranscript
from semantic_tui.widgets.event_log import EventLogView
from tests.support.scripted_engine import ScriptedEngine
from tests.support.workbench import workbench


async def wait_for(pilot, condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.05)


def ready(app) -> bool:
    """Model loaded, HTTP listening, and the loading screen gone (it swallows key presses)."""
    return app.backend.service.is_ready and app.backend.listener is not None and app.screen is app.main


def table_ids(app) -> list[str]:
    table = app.query_one(AgentsTable)
    return [table.coordinate_to_cell_key((row, 0)).row_key.value for row in range(table.row_count)]


async def test_model_loads_and_http_listener_is_shown(tmp_path: Path) -> None:
    app = workbench(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.backend.listener is not None)
        assert app.backend.service.is_ready
        status = str(app.query_one("#status").render())
        assert app.backend.listener.url in status and "ready" in status


async def test_new_chat_sends_a_turn_and_the_agent_appears(tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda r: "An **answer**.")
    app = workbench(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        await pilot.press("n")
        await pilot.press(*"hello", "enter")
        await wait_for(pilot, lambda: "chat-1" in table_ids(app))
        area = app.query_one(ChatArea)
        pane = area.pane_for("chat-1")
        await wait_for(pilot, lambda: len(pane.history) == 2)
        assert pane.history[-1].content == "An **answer**."
        assert engine.requests[-1].source is AgentSource.TUI


async def test_evict_from_the_table_moves_the_agent_to_warm(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    app = workbench(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        engine.submit(GenerationRequest("victim", tuple(b"x" * 64), 4), lambda e: None)
        await wait_for(pilot, lambda: "victim" in table_ids(app))
        app.query_one(AgentsTable).focus()
        await pilot.press("e")
        await wait_for(pilot, lambda: engine.snapshot().agent("victim").tier == "warm")
        await pilot.pause(0.3)
        assert engine.pool.owned_blocks("victim") == 0
        log_text = "\n".join(str(line) for line in app.query_one(EventLogView).lines)
        assert "victim: hot -> warm" in log_text


async def test_pin_and_evict_idle(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    app = workbench(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        for name in ("keep", "go"):
            engine.submit(GenerationRequest(name, tuple(b"y" * 40), 4), lambda e: None)
        await wait_for(pilot, lambda: {"keep", "go"} <= set(table_ids(app)) and all(
            engine.snapshot().agent(a).tier == "hot" for a in ("keep", "go")))
        table = app.query_one(AgentsTable)
        table.focus()
        table.move_cursor(row=table.get_row_index("keep"))
        await pilot.press("p")
        await wait_for(pilot, lambda: engine.agents["keep"].pinned)
        await pilot.press("E")
        await wait_for(pilot, lambda: engine.agents["go"].tier.value == "warm")
        assert engine.agents["keep"].tier.value == "hot"


async def test_theme_switch_is_remembered(tmp_path: Path) -> None:
    app = workbench(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        before = app.theme
        await pilot.press("t")
        assert app.theme != before
        chosen = app.theme
    again = workbench(tmp_path)
    async with again.run_test(size=(100, 30)) as pilot:
        await pilot.pause(0.1)
        assert again.theme == chosen


async def test_an_http_client_appears_as_an_agent_within_a_second(tmp_path: Path) -> None:
    app = workbench(tmp_path, ScriptedEngine(lambda r: "pong"))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.backend.listener is not None)
        url = app.backend.listener.url
        body = {"model": "claude-opus-5-5", "max_tokens": 64, "messages": [{"role": "user", "content": "ping"}]}
        headers = {"x-api-key": "any", "X-Claude-Code-Session-Id": "0123abcd-0000-4000-8000-00000000beef"}
        async with httpx.AsyncClient() as client:
            response = await client.post(f"{url}/v1/messages", json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        start = asyncio.get_running_loop().time()
        await wait_for(pilot, lambda: any(i.startswith("cc-0123abcd") for i in table_ids(app)), timeout_s=1.0)
        assert asyncio.get_running_loop().time() - start < 1.0
        row = app.query_one(AgentsTable).get_row(next(i for i in table_ids(app) if i.startswith("cc-")))
        assert "Claude Code" in str(row[0])


async def test_watching_a_claude_code_session_is_read_only(tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda r: "watched reply", token_delay_s=0.01)
    app = workbench(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        engine.submit(GenerationRequest("cc-x", tuple(b"z" * 20), 4, source=AgentSource.CLAUDE_CODE, display_name="Claude Code x"), lambda e: None)
        await wait_for(pilot, lambda: "cc-x" in table_ids(app))
        table = app.query_one(AgentsTable)
        table.focus()
        table.move_cursor(row=table.get_row_index("cc-x"))
        await pilot.press("c")
        pane = app.query_one(ChatArea).pane_for("cc-x")
        await wait_for(pilot, lambda: pane is not None)
        assert pane.read_only
        engine.submit(GenerationRequest("cc-x", tuple(b"z" * 30), 40, source=AgentSource.CLAUDE_CODE), lambda e: None)
        await wait_for(pilot, lambda: "watched reply" in pane.query_one(ChatTranscript).plain_text(), timeout_s=5)


async def test_quit_stops_the_engine(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    app = workbench(tmp_path, engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        await pilot.press("q")
        await pilot.pause(0.5)
    assert not engine.is_running


async def test_command_palette_lists_area_verb_commands(tmp_path: Path) -> None:
    app = workbench(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        from semantic_tui.palette import WorkbenchCommands

        names = [name for name, _, _ in WorkbenchCommands(app.screen)._commands()]
        for expected in ("agent: evict to disk", "agent: drop", "agent: pin", "agent: open chat", "pool: evict all idle",
                         "view: theme", "app: quit"):
            assert any(n.startswith(expected) for n in names), expected
        await pilot.press("ctrl+p")
        await pilot.press(*"evict all")
        await pilot.pause(0.3)
        assert app.screen.__class__.__name__ == "CommandPalette"


def test_every_palette_command_names_an_action_the_app_has() -> None:
    from semantic_tui.app import SemanticApp
    from semantic_tui.palette import ACTIONS

    assert [a for *_, a in ACTIONS if not callable(getattr(SemanticApp, f"action_{a}", None))] == []


async def test_a_palette_command_runs_its_action(tmp_path: Path) -> None:
    from semantic_tui.widgets.chat_area import ChatArea

    app = workbench(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        await pilot.press("ctrl+p")
        await pilot.press(*"chat: new")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.main.query_one(ChatArea).pane_count == 1)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_layout_fits_small_and_large_terminals(tmp_path: Path, size: tuple[int, int]) -> None:
    app = workbench(tmp_path)
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: ready(app))
        for widget_id in ("#agents", "#pool", "#bottom"):
            region = app.query_one(widget_id).region
            assert region.width > 10 and region.height >= 3, (widget_id, region)
        if size[1] < 36:
            await pilot.press("v")
            assert app.query_one("#tiers").display


async def test_model_swap_from_the_picker_rebuilds_the_panes(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    app = workbench(tmp_path, engine, model="scripted")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        engine.submit(GenerationRequest("keeper", tuple(b"k" * 40), 4), lambda e: None)
        await wait_for(pilot, lambda: "keeper" in table_ids(app))
        await pilot.press("m")
        picker = app.screen
        assert picker.__class__.__name__ == "ModelPicker"
        target = next(i for i, e in enumerate(picker.entries) if not e.loaded)
        picker.dismiss(picker.entries[target])
        await pilot.pause(0.2)
        assert app.screen.__class__.__name__ == "ConfirmDialog"
        assert "Spill 1 hot agents" in app.screen.body
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.backend.service.swapper.status.running, timeout_s=10)
        assert app.backend.service.swapper.status.phase.value == "done", app.backend.service.swapper.status
        await wait_for(pilot, lambda: app.backend.service.is_ready
                       and app.backend.service.engine.loaded.model_id == picker.entries[target].model_id, timeout_s=10)
        await wait_for(pilot, lambda: app.screen.__class__.__name__ not in ("SwapProgressScreen", "ConfirmDialog"))
        assert not engine.is_running
        await wait_for(pilot, lambda: "keeper" in table_ids(app))  # identity kept across the swap
        status = str(app.query_one("#status").render())
        assert picker.entries[target].model_id in status


async def test_the_empty_agents_pane_says_how_to_start_until_the_first_agent(tmp_path: Path) -> None:
    from semantic_tui.widgets.agents_hint import AgentsHint

    app = workbench(tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: ready(app) and app.query_one(AgentsHint).url is not None)
        hint = app.query_one(AgentsHint)
        text = str(hint.render())
        url = hint.url
        assert hint.display and "Press n for a chat" in text
        assert f"ANTHROPIC_BASE_URL={url} ANTHROPIC_API_KEY=local claude" in text
        assert f'base_url = "{url}/v1"' in text and 'wire_api = "responses"' in text
        await pilot.press("n")
        await pilot.press(*"hello", "enter")
        await wait_for(pilot, lambda: "chat-1" in table_ids(app))
        await wait_for(pilot, lambda: not hint.display)


async def test_quit_is_shown_and_heard_while_a_chat_input_has_focus(tmp_path: Path) -> None:
    from textual.widgets import Input, TextArea

    app = workbench(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ready(app))
        await pilot.press("n")
        await pilot.pause(0.2)
        assert isinstance(app.focused, (Input, TextArea))
        shown = {binding.key for _, binding, enabled, _ in app.screen.active_bindings.values() if binding.show}
        assert "ctrl+q" in shown
        await pilot.press("q")  # a letter typed into the chat, not a quit
        assert app.is_running
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running, timeout_s=10)


async def test_the_top_line_says_slow_blas_while_mlx_runs_on_its_bundled_blas(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import semantic_tui.app as app_module

    for slow in (True, False):
        monkeypatch.setattr(app_module, "slow_blas", lambda: slow)
        app = workbench(tmp_path / str(slow))
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_for(pilot, lambda: ready(app))
            status = str(app.query_one("#status").render())
            assert ("SLOW BLAS" in status and "semantic doctor" in status) == slow
