"""The workbench attached to a running server (``semantic attach``): the same panes and controls over HTTP.

A scripted engine behind the real HTTP app (a uvicorn thread) stands in for
``semantic --serve``; the attached app reads its ``/v1/stream`` and steers it
through the API, and every assertion is read back from the server's engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from engine.api.listener_file import recorded_listener, remove_listener, write_listener
from engine.domain.requests import AgentSource, GenerationRequest
from engine.errors import SemanticError
from semantic_cli.attach import server_address
from engine.settings import load_settings
from semantic_tui.app import SemanticApp
from semantic_tui.preferences import load_preferences
from semantic_tui.remote_client import RemoteClient
from semantic_tui.sse_client import sse_frames
from semantic_tui.chat_events import PaneState
from semantic_tui.screens.branching import TurnPicker
from semantic_tui.screens.dialogs import ConfirmDialog
from semantic_tui.screens.model_picker import ModelPicker, SwapProgressScreen
from semantic_tui.widgets.agents_table import AgentsTable
from semantic_tui.widgets.chat_area import ChatArea
from semantic_tui.widgets.event_log import EventLogView
from semantic_tui.widgets.pool_map import PoolMap
from semantic_tui.widgets.status_bar import StatusBar
from semantic_tui.workbench_client import AgentAction
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine
from tests.support.workbench import workbench


async def wait_for(pilot, condition, what: str, timeout_s: float = 8.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not in time: {what}")
        await pilot.pause(0.05)


def attached(url: str, tmp_path: Path, api_key: str | None = None) -> SemanticApp:
    return SemanticApp(RemoteClient(url, api_key=api_key, interval_s=0.1), load_preferences(tmp_path / "wb.json"),
                       poll_interval_s=0.1)


def table_ids(app: SemanticApp) -> list[str]:
    table = app.query_one(AgentsTable)
    return [table.coordinate_to_cell_key((row, 0)).row_key.value for row in range(table.row_count)]


def select(app: SemanticApp, agent_id: str) -> AgentsTable:
    table = app.query_one(AgentsTable)
    table.focus()
    table.move_cursor(row=table.get_row_index(agent_id))
    return table


async def new_chat(pilot, app: SemanticApp):
    """n, once the first stream has come: the new chat's pane."""
    await wait_for(pilot, lambda: app.client.state().snapshot is not None, "the first stream")
    await pilot.press("n")
    area = app.query_one(ChatArea)
    await wait_for(pilot, lambda: area.pane_count == 1, "a chat pane")
    return area.panes[0]


def status_text(app: SemanticApp) -> str:
    return str(app.query_one(StatusBar).render())


@pytest.fixture
def server(tmp_path: Path):
    engine = ScriptedEngine()
    service = make_service(tmp_path / "cache", engine)
    with LiveServer(build_app(service)) as live:
        yield engine, service, live


async def test_the_attached_panes_show_the_servers_agents_pool_and_log(server, tmp_path: Path) -> None:
    engine, service, live = server
    engine.submit(GenerationRequest("remote-a", tuple(b"x" * 64), 4), lambda e: None)
    app = attached(live.url, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: "remote-a" in table_ids(app), "the server's agent in the table")
        assert app.backend is None and not app.client.embedded
        assert live.url in status_text(app) and "ready" in status_text(app)
        # The pool map draws the server's blocks: the agent's share of the pool as the server counts it.
        owned = engine.snapshot().pool.owner_blocks["remote-a"]
        assert owned > 0 and app.query_one(PoolMap)._view.pool.owner_blocks["remote-a"] == owned
        engine.submit(GenerationRequest("remote-b", tuple(b"y" * 32), 4), lambda e: None)
        await wait_for(pilot, lambda: "remote-b" in table_ids(app), "a new agent appears live")
        lines = lambda: "\n".join(str(line) for line in app.query_one(EventLogView).lines)  # noqa: E731
        await wait_for(pilot, lambda: "remote-b" in lines(), "the server's events in the log pane")


async def test_controls_act_on_the_server_and_quitting_leaves_it_running(server, tmp_path: Path) -> None:
    engine, service, live = server
    for name in ("keep", "go", "victim"):
        engine.submit(GenerationRequest(name, tuple(b"z" * 40), 4), lambda e: None)
    app = attached(live.url, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: {"keep", "go", "victim"} <= set(table_ids(app)), "three agents listed")
        table = select(app, "victim")
        await pilot.press("e")
        await wait_for(pilot, lambda: engine.agents["victim"].tier.value == "warm", "evicted on the server")
        table.move_cursor(row=table.get_row_index("keep"))
        await pilot.press("p")
        await wait_for(pilot, lambda: engine.agents["keep"].pinned, "pinned on the server")
        await wait_for(pilot, lambda: app.client.state().snapshot.agent("keep").pinned, "the pin seen back")
        await pilot.press("E")
        await wait_for(pilot, lambda: engine.agents["go"].tier.value == "warm", "evict idle on the server")
        assert engine.agents["keep"].tier.value == "hot"
        table.move_cursor(row=table.get_row_index("keep"))
        await pilot.press("f")
        await wait_for(pilot, lambda: "keep-fork-1" in engine.agents, "the fork made on the server")
        await wait_for(pilot, lambda: "keep-fork-1" in table_ids(app), "the fork listed")
        assert set(engine.agents) == {"keep", "go", "victim", "keep-fork-1"}
        await pilot.press("q")
        await wait_for(pilot, lambda: not app.is_running, "the attached workbench quits")
    assert service.is_ready and engine.is_running
    assert httpx.get(f"{live.url}/health/ready").status_code == 200


async def test_an_attached_chat_is_a_direct_agent_of_the_server_and_rewinds_there(server, tmp_path: Path) -> None:
    """n opens a chat whose turns go through POST /v1/agents/{id}/messages: the reply streams into the pane
    with its usage line, the server keeps the conversation, and r takes it back a turn on the server."""
    engine, _service, live = server
    app = attached(live.url, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        pane = await new_chat(pilot, app)
        assert pane.agent_id == "chat-1" and not pane.read_only
        for text in ("Name a colour.", "Another one."):
            pane.input.value = text
            await pilot.press("enter")
            await wait_for(pilot, lambda: pane.state is PaneState.IDLE and "generated" in transcript(pane),
                           "the reply and its usage line")
            await wait_for(pilot, lambda: transcript(pane).count("generated") == (1 if text[0] == "N" else 2),
                           "one usage line a turn")
        conversation = httpx.get(f"{live.url}/v1/agents/chat-1").json()
        assert conversation["source"] == "api" and conversation["turns"] == 2
        await wait_for(pilot, lambda: "chat-1" in table_ids(app), "the chat's agent listed")
        await wait_for(pilot, lambda: len(app.client.state().snapshot.agent("chat-1").turn_ends) == 2,
                       "both turns in the stats")
        select(app, "chat-1")
        await pilot.press("r")
        await wait_for(pilot, lambda: isinstance(app.screen, TurnPicker), "the turn picker")
        await pilot.press("down", "enter")  # newest first: turn 2 (now), then turn 1
        await wait_for(pilot, lambda: len(engine.agents["chat-1"].turn_ends) == 1, "rewound on the server")
        assert httpx.get(f"{live.url}/v1/agents/chat-1").json()["messages"] == 2  # its conversation with it


async def test_esc_in_an_attached_chat_stops_the_turn_on_the_server(tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda r: "word " * 400, token_delay_s=0.01)
    service = make_service(tmp_path / "cache", engine)
    with LiveServer(build_app(service)) as live:
        app = attached(live.url, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            pane = await new_chat(pilot, app)
            pane.input.value = "Talk for a while."
            await pilot.press("enter")
            await wait_for(pilot, lambda: pane.state is PaneState.GENERATING, "the reply streaming")
            await pilot.press("escape")
            await wait_for(pilot, lambda: pane.state is PaneState.IDLE and "stopped" in transcript(pane),
                           "the turn stopped")
            await wait_for(pilot, lambda: engine.cancelled, "the server cancelled it (the connection closed)")
            assert engine.agents["chat-1"].state == "idle" and len(engine.agents["chat-1"].tokens) < 2000


async def test_a_workbench_attached_to_another_swaps_its_model(tmp_path: Path) -> None:
    """Attached to an embedded workbench's listener: m lists the server's models (GET /v1/models), the swap runs
    on the server (POST /v1/admin/swap) with its progress screen fed from GET /v1/admin/swap, and the panes
    follow the new model."""
    engine = ScriptedEngine()
    host = workbench(tmp_path / "host", engine, model="scripted")
    async with host.run_test(size=(120, 40)) as host_pilot:
        await wait_for(host_pilot, lambda: host.backend.service.is_ready and host.backend.listener is not None,
                       "the host workbench's listener")
        engine.submit(GenerationRequest("keeper", tuple(b"k" * 40), 4), lambda e: None)
        app = attached(host.backend.listener.url, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: "keeper" in table_ids(app), "the host's agent")
            await pilot.press("m")
            await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker), "the picker")
            picker = app.screen
            target = next(entry for entry in picker.entries if not entry.loaded)
            assert any(entry.loaded and entry.model_id == "scripted" for entry in picker.entries)
            picker.dismiss(target)
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "the confirmation")
            assert "Spill 1 hot agents" in app.screen.body
            await pilot.press("enter")
            swapper = host.backend.service.swapper
            await wait_for(pilot, lambda: not swapper.status.running and swapper.status.phase.value == "done",
                           "the swap done on the server", timeout_s=15)
            # The progress screen (fed by GET /v1/admin/swap) saw it end: it closed with the swap's result.
            notices = lambda: [n.message for n in app._notifications]  # noqa: E731
            await wait_for(pilot, lambda: any(m.startswith(f"Now serving {target.model_id}") for m in notices()),
                           "the progress screen's ending")
            assert not isinstance(app.screen, SwapProgressScreen)
            await wait_for(pilot, lambda: app.client.state().snapshot is not None and
                           app.client.state().snapshot.model.model_id == target.model_id, "the new model's panes")
            await wait_for(pilot, lambda: "keeper" in table_ids(app), "the agent kept across the swap")


async def test_another_clients_agent_opens_read_only_and_says_where_its_turns_show(server, tmp_path: Path) -> None:
    engine, _service, live = server
    engine.submit(GenerationRequest("cc-session", tuple(b"c" * 40), 4, source=AgentSource.CLAUDE_CODE,
                                    display_name="Claude Code 7f3a9c1e"), lambda e: None)
    app = attached(live.url, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: "cc-session" in table_ids(app), "the Claude Code session listed")
        select(app, "cc-session")
        await pilot.press("c")
        area = app.query_one(ChatArea)
        await wait_for(pilot, lambda: area.pane_count == 1, "its pane")
        pane = area.panes[0]
        assert pane.read_only and pane.input.disabled
        await wait_for(pilot, lambda: "not streamed to an attached workbench" in transcript(pane), "the note")


def transcript(pane) -> str:
    return "\n".join(str(widget.render()) for widget in pane.transcript.query("Static"))


async def test_a_refused_control_says_the_servers_reason(server, tmp_path: Path) -> None:
    engine, _service, live = server
    client = RemoteClient(live.url)
    try:
        with pytest.raises(SemanticError, match="agent 'nobody' does not exist"):
            await client.agent_action(None, "nobody", AgentAction.EVICT)
    finally:
        await client.close()


async def test_the_workbench_reconnects_when_the_server_restarts(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    service = make_service(tmp_path / "cache", engine)
    first = LiveServer(build_app(service))
    first.__enter__()
    port = first.port
    app = attached(first.url, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.client.state().snapshot is not None, "the first stream")
        first.__exit__(None, None, None)
        await wait_for(pilot, lambda: app.client.state().link is not None, "the lost link noticed")
        await pilot.pause(0.2)
        assert "retrying" in status_text(app)
        engine.submit(GenerationRequest("after-restart", tuple(b"r" * 24), 4), lambda e: None)
        with LiveServer(build_app(service), port=port):
            await wait_for(pilot, lambda: "after-restart" in table_ids(app), "the restarted server's agents",
                           timeout_s=15)
            assert app.client.connections == 2 and app.client.state().link is None
            assert "retrying" not in status_text(app)
            await pilot.press("q")


async def test_two_attached_workbenches_see_the_same_state(server, tmp_path: Path) -> None:
    engine, _service, live = server
    engine.submit(GenerationRequest("shared", tuple(b"s" * 48), 4), lambda e: None)
    one, two = attached(live.url, tmp_path / "one"), attached(live.url, tmp_path / "two")
    async with one.run_test(size=(120, 40)) as pilot_one, two.run_test(size=(120, 40)) as pilot_two:
        await wait_for(pilot_one, lambda: "shared" in table_ids(one), "the first workbench's table")
        await wait_for(pilot_two, lambda: "shared" in table_ids(two), "the second workbench's table")
        table = one.query_one(AgentsTable)
        table.focus()
        await pilot_one.press("d")  # dropped from the first workbench: the second sees it cold
        await wait_for(pilot_two, lambda: two.client.state().snapshot.agent("shared").tier == "cold",
                       "the drop seen by the other workbench")


async def test_a_server_with_an_api_key_refuses_an_attach_without_it(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    service = make_service(tmp_path / "cache", engine, api_key="sesame")
    engine.submit(GenerationRequest("secret", tuple(b"k" * 24), 4), lambda e: None)
    with LiveServer(build_app(service)) as live:
        refused = attached(live.url, tmp_path / "no-key")
        async with refused.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: "API key" in status_text(refused), "the refusal on the top line")
            assert refused.client.state().snapshot is None and table_ids(refused) == []
        allowed = attached(live.url, tmp_path / "key", api_key="sesame")
        async with allowed.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: "secret" in table_ids(allowed), "the agents with the key")


async def test_an_unreachable_server_is_one_clear_line(tmp_path: Path) -> None:
    app = attached("http://127.0.0.1:9", tmp_path)  # the discard port: nothing listens
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: "cannot reach http://127.0.0.1:9" in status_text(app), "the line")
        assert "retrying in" in status_text(app)


async def test_sse_frames_parse_comments_multiline_data_and_ids() -> None:
    async def lines():
        for line in (": keep-alive", "", "event: log", "id: 7", 'data: {"a":', "data: 1}", "", "data: x", ""):
            yield line

    frames = [frame async for frame in sse_frames(lines())]
    assert [(f.event, f.data, f.id) for f in frames] == [("log", '{"a":\n1}', "7"), ("message", "x", None)]


def test_attach_finds_the_running_server_of_its_cache_dir(tmp_path: Path) -> None:
    settings = load_settings(cache_dir=tmp_path, port=8642, preload_openblas=False)
    assert server_address(settings, None) == "http://127.0.0.1:8642"  # nothing recorded: the defaults
    write_listener(tmp_path, "http://127.0.0.1:40123")
    assert recorded_listener(tmp_path) == "http://127.0.0.1:40123"
    assert server_address(settings, None) == "http://127.0.0.1:40123"
    assert server_address(settings, "10.1.2.3:9000") == "http://10.1.2.3:9000"
    remove_listener(tmp_path)
    assert recorded_listener(tmp_path) is None


def test_a_dead_servers_record_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "listener.json").write_text('{"url": "http://127.0.0.1:1", "pid": 999999999, "started_at": 0}')
    assert recorded_listener(tmp_path) is None
