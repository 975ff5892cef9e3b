"""The swap progress screen closes exactly once, however its poll ticks fall."""

from __future__ import annotations

from types import SimpleNamespace

from textual.app import App

from engine.swap import SwapPhase, SwapStatus
from semantic_tui.screens.model_picker import SwapProgressScreen


async def test_a_poll_that_lands_while_the_screen_closes_does_not_dismiss_it_twice() -> None:
    # CI once saw the second tick pop the screen below (ScreenStackError): dismissing is asynchronous.
    done = SwapStatus(phase=SwapPhase.DONE, from_model="a", to_model="b", seconds={"loading": 0.1})
    swapper = SimpleNamespace(status=SwapStatus(phase=SwapPhase.LOADING, from_model="a", to_model="b"))
    results: list[SwapStatus | None] = []
    app = App()
    async with app.run_test() as pilot:
        screen = SwapProgressScreen(swapper, poll_s=60)
        app.push_screen(screen, results.append)
        await pilot.pause()
        swapper.status = done
        # Two ticks queued on the screen before the first one's pop completes.
        screen.call_later(screen._poll)
        screen.call_later(screen._poll)
        await pilot.pause()
        assert results == [done]
        assert len(app.screen_stack) == 1
