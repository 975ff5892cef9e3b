"""The workbench steers scheduling: the agents table as a tree of each client session with class and priority,
and the keys that raise, lower, pause and resume an agent, in the embedded and the attached workbench."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.text import Text

from engine.domain.priority import AgentClass, Lineage
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.snapshot import ClassView, ThroughputView
from semantic_tui.widgets.agents_table import AgentsTable
from semantic_tui.widgets.throughput_panel import classes_text
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine
from tests.support.workbench import workbench
from tests.unit.test_attached_workbench import attached, select, table_ids, wait_for

pytestmark = pytest.mark.unit

FAMILY = Lineage("cc-session-1")


def claude_code_session(engine: ScriptedEngine) -> None:
    """A main agent, then an unrelated agent, then a subagent of the first session: the subagent is drawn
    under its main agent, not after the unrelated one."""
    for agent_id, agent_class, lineage in (("cc-main", AgentClass.MAIN, FAMILY), ("other", AgentClass.MAIN, Lineage()),
                                          ("cc-sub", AgentClass.SUBAGENT, FAMILY)):
        name = "Claude Code 5f0c / subagent 3f2a" if agent_id == "cc-sub" else ""
        engine.submit(GenerationRequest(agent_id, tuple(b"q" * 40), 4, agent_class=agent_class, lineage=lineage,
                                        display_name=name), lambda e: None)


def cell(app, agent_id: str, column: str) -> str:
    table = app.query_one(AgentsTable)
    value = table.get_cell(agent_id, column)
    return value.plain if isinstance(value, Text) else str(value)


async def steer_with_keys(pilot, app, engine: ScriptedEngine) -> None:
    await wait_for(pilot, lambda: table_ids(app) == ["cc-main", "cc-sub", "other"], "the session's agents as a tree")
    assert cell(app, "cc-sub", "agent").startswith("└ ") and not cell(app, "cc-main", "agent").startswith("└")
    assert "subagent 3f2a" in cell(app, "cc-sub", "agent") and "5f0c" not in cell(app, "cc-sub", "agent")
    assert cell(app, "cc-sub", "priority") == "sub 3" and cell(app, "cc-main", "priority") == "main 1"
    select(app, "cc-sub")
    await pilot.press("right_square_bracket")
    await wait_for(pilot, lambda: engine.agents["cc-sub"].priority == 2, "raised one level")
    await wait_for(pilot, lambda: cell(app, "cc-sub", "priority") == "sub 2*", "the table shows the operator's level")
    await pilot.press("left_square_bracket", "left_square_bracket")
    await wait_for(pilot, lambda: engine.agents["cc-sub"].priority == 4, "lowered two levels")
    await pilot.press("space")
    await wait_for(pilot, lambda: engine.agents["cc-sub"].paused, "paused")
    await wait_for(pilot, lambda: cell(app, "cc-sub", "state") == "paused", "the table says paused")
    await pilot.press("space")
    await wait_for(pilot, lambda: not engine.agents["cc-sub"].paused, "resumed")


async def test_the_embedded_workbench_draws_sessions_as_trees_and_steers_agents(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    app = workbench(tmp_path, engine)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.client.state().snapshot is not None, "the engine")
        claude_code_session(engine)
        await steer_with_keys(pilot, app, engine)


async def test_the_attached_workbench_steers_the_servers_agents(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    with LiveServer(build_app(make_service(tmp_path / "cache", engine))) as live:
        claude_code_session(engine)
        app = attached(live.url, tmp_path)
        async with app.run_test(size=(160, 48)) as pilot:
            await steer_with_keys(pilot, app, engine)


def test_the_throughput_pane_lists_each_classs_service() -> None:
    assert not classes_text(ThroughputView())
    text = classes_text(ThroughputView(classes=(
        ClassView("main", 3, 0.6, 0.9, 0.05, 0.1, 0.3), ClassView("subagent", 6, 2.0, 4.0, 0.2, 0.5, 0.9)),
        gap_target_s=0.36, paced_prefill_tokens=120)).plain
    assert "paced prefill 120 tok/step · gap target 360ms" in text
    assert "main        TTFT 600ms/900ms · gap p95 100ms max 300ms" in text
    assert "subagent    TTFT 2.00s/4.00s · gap p95 500ms max 900ms" in text
