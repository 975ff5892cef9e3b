"""What two chat panes look like after a finished turn (pytest-textual-snapshot).

Deterministic by construction: scripted replies, the scripted engine's fixed
TTFT and tok/s, no wall-clock text, and no blinking cursor.
"""

from __future__ import annotations

from textual.pilot import Pilot

from engine.domain.requests import GenerationRequest
from tests.support.scripted_engine import ScriptedEngine

from .test_tui_chat import ChatTestApp, say, wait_until

REPLIES = {
    "planner": "Here is the **plan**:\n\n1. read the code\n2. write the tests",
    "reviewer": "Looks good. One *nit*: rename `foo`.",
}


def scripted_reply(request: GenerationRequest) -> str:
    return REPLIES[request.agent_id]


async def two_finished_turns(pilot: Pilot) -> None:
    app = pilot.app
    assert isinstance(app, ChatTestApp)
    planner = await app.area.open_chat("planner", "Planner")
    reviewer = await app.area.open_chat("reviewer", "Reviewer")
    for pane in (planner, reviewer):
        pane.input.cursor_blink = False
    await say(pilot, planner, "Plan the work")
    await say(pilot, reviewer, "Review it")
    await wait_until(pilot, lambda: len(app.finished()) == 2)
    planner.input.focus()
    await pilot.pause()


def test_two_panes_after_a_finished_turn(snap_compare) -> None:
    app = ChatTestApp(ScriptedEngine(scripted_reply))
    assert snap_compare(app, terminal_size=(100, 30), run_before=two_finished_turns)
