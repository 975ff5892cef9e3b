"""Fork, rewind, export and import from the workbench (keys f, r, x, X), on a real engine with a
tiny model: the engine's branching runs for real, the screens are driven with Pilot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.settings import load_settings
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from semantic_tui.app import SemanticApp
from semantic_tui.backend import WorkbenchBackend
from semantic_tui.preferences import load_preferences
from semantic_tui.screens.branching import PathPrompt, TurnPicker
from semantic_tui.widgets.agents_table import AgentsTable
from semantic_tui.widgets.chat_area import ChatArea
from tests.support.byte_tokenizer import BOS
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_tui_app import ready, table_ids, wait_for

pytestmark = pytest.mark.unit


def tiny_workbench(tmp_path: Path) -> tuple[SemanticApp, Engine]:
    settings = load_settings(cache_dir=tmp_path / "cache", port=0, preload_openblas=False)
    loaded = loaded_tiny("llama")
    store = WarmStore(settings.agents_dir, stored_model(loaded), 1 << 30, EventLog())
    engine = Engine(loaded, engine_settings(64 << 20, 8, 32), store=store)

    def factory(settings, events, progress):
        engine.start()
        return engine

    backend = WorkbenchBackend(settings, factory)
    return SemanticApp(backend, load_preferences(tmp_path / "workbench.json"), poll_interval_s=0.1), engine


def select(app: SemanticApp, agent_id: str) -> None:
    table = app.query_one(AgentsTable)
    table.focus()
    table.move_cursor(row=table.get_row_index(agent_id))


async def test_fork_rewind_export_and_import_from_the_keyboard(tmp_path: Path) -> None:
    app, engine = tiny_workbench(tmp_path)
    try:
        await _drive(app, engine, tmp_path)
    finally:
        await asyncio.to_thread(engine.stop, 0.0)


async def _drive(app: SemanticApp, engine: Engine, tmp_path: Path) -> None:
    async with app.run_test(size=(140, 44)) as pilot:
        await wait_for(pilot, lambda: ready(app), timeout_s=30)
        prompt = (BOS, *b"The planner wrote a plan with several parts. " * 3)
        for turn in range(2):
            result = await asyncio.to_thread(run_turn, engine, GenerationRequest("planner", prompt, 6))
            prompt = prompt + tuple(result.tokens) + tuple(f" next {turn}.".encode())
        await wait_for(pilot, lambda: "planner" in table_ids(app))

        select(app, "planner")
        await pilot.press("f")
        await wait_for(pilot, lambda: "planner-fork-1" in table_ids(app))
        assert app.query_one(ChatArea).pane_for("planner-fork-1") is not None
        fork = engine.call(lambda e: (len(e.agents.get("planner-fork-1").tokens),
                                      e.agents.get("planner-fork-1").kv.base)).result()
        assert fork[0] == len(engine.call(lambda e: e.agents.get("planner").tokens).result()) and fork[1] > 0

        select(app, "planner")
        await pilot.press("r")
        await wait_for(pilot, lambda: isinstance(app.screen, TurnPicker))
        await pilot.press("down", "enter")  # newest first: turn 2 (now), then turn 1
        first_end = engine.call(lambda e: e.agents.get("planner").turn_ends).result()
        await wait_for(pilot, lambda: len(engine.call(lambda e: e.agents.get("planner").turn_ends).result()) == 1)
        assert engine.call(lambda e: len(e.agents.get("planner").tokens)).result() <= first_end[0]

        out = tmp_path / "planner.agent.safetensors"
        select(app, "planner")
        await pilot.press("x")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one("Input").value = str(out)
        await pilot.press("enter")
        await wait_for(pilot, lambda: out.exists(), timeout_s=10)

        engine.call(lambda e: e.ops.delete_agent("planner")).result()
        await wait_for(pilot, lambda: "planner" not in table_ids(app))
        await pilot.press("X")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one("Input").value = str(out)
        await pilot.press("enter")
        await wait_for(pilot, lambda: "planner" in table_ids(app), timeout_s=10)
        assert engine.snapshot().agent("planner").tier == "warm"


async def test_an_attached_workbench_exports_and_imports_through_the_server(tmp_path: Path) -> None:
    """x in a workbench attached to another's listener downloads the agent file to this machine
    (GET /v1/agents/{id}/export), X uploads it back (POST /v1/agents/import): the real engine's files."""
    from semantic_tui.remote_client import RemoteClient

    host, engine = tiny_workbench(tmp_path / "host")
    try:
        async with host.run_test(size=(120, 40)) as host_pilot:
            await wait_for(host_pilot, lambda: ready(host), timeout_s=30)
            prompt = (BOS, *b"The archivist kept every note it was given. " * 3)
            await asyncio.to_thread(run_turn, engine, GenerationRequest("archivist", prompt, 6))
            app = SemanticApp(RemoteClient(host.backend.listener.url, interval_s=0.1),
                              load_preferences(tmp_path / "attached.json"), poll_interval_s=0.1)
            async with app.run_test(size=(140, 44)) as pilot:
                await wait_for(pilot, lambda: "archivist" in table_ids(app), timeout_s=10)
                cached = engine.snapshot().agent("archivist").cached_tokens
                out = tmp_path / "exports" / "archivist.agent.safetensors"
                out.parent.mkdir()
                select(app, "archivist")
                await pilot.press("x")
                await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
                app.screen.query_one("Input").value = str(out)
                await pilot.press("enter")
                await wait_for(pilot, lambda: out.exists(), timeout_s=10)
                assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp file left beside it
                engine.call(lambda e: e.ops.delete_agent("archivist")).result()
                await wait_for(pilot, lambda: "archivist" not in table_ids(app), timeout_s=10)
                await pilot.press("X")
                await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
                app.screen.query_one("Input").value = str(out)
                await pilot.press("enter")
                await wait_for(pilot, lambda: "archivist" in table_ids(app), timeout_s=10)
                view = engine.snapshot().agent("archivist")
                assert view.tier == "warm" and view.cached_tokens == cached
    finally:
        await asyncio.to_thread(engine.stop, 0.0)
