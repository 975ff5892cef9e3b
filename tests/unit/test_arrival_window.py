"""An idle engine waits for a burst's later requests, and steps a lone request at once."""

from __future__ import annotations

from dataclasses import replace

from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.arrival_window import ArrivalWindow
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from tests.support.byte_tokenizer import BOS
from tests.support.engine_settings import engine_settings
from tests.support.tiny_models import loaded_tiny

WINDOW = 0.01


def test_a_fresh_engine_waits_for_a_burst() -> None:
    assert ArrivalWindow(WINDOW).woke(0.0, 1) == WINDOW


def test_a_wake_with_no_follower_turns_the_wait_off() -> None:
    window = ArrivalWindow(WINDOW)
    window.woke(0.0, 1)
    window.arrived(5.0)  # the next request, long after the window
    assert window.woke(5.0, 1) == 0.0
    assert not window.clustering


def test_a_request_following_a_wake_within_the_window_turns_it_back_on() -> None:
    window = ArrivalWindow(WINDOW)
    window.woke(0.0, 1)
    window.arrived(5.0)
    assert window.woke(5.0, 1) == 0.0  # a lone request: stepped at once
    window.arrived(5.004)  # ...and a second one 4 ms behind it: a burst after all
    window.arrived(9.0)
    assert window.woke(9.0, 1) == WINDOW


def test_a_request_after_the_window_is_no_follower() -> None:
    window = ArrivalWindow(WINDOW)
    window.woke(0.0, 1)
    window.arrived(0.02)
    assert window.woke(0.02, 1) == 0.0


def test_several_waiting_at_the_wake_are_a_burst() -> None:
    window = ArrivalWindow(WINDOW)
    window.woke(0.0, 1)
    assert window.woke(5.0, 1) == 0.0
    assert window.woke(9.0, 3) == WINDOW


def test_a_zero_window_never_waits() -> None:
    window = ArrivalWindow(0.0)
    assert window.woke(0.0, 1) == 0.0
    window.arrived(0.0)
    assert window.woke(0.0, 4) == 0.0


def test_the_engine_steps_a_lone_turn_at_once_and_gathers_a_burst() -> None:
    """A window long enough to see in the time to first token (1 s against a tiny model's milliseconds)."""
    loaded = loaded_tiny("llama")
    settings = engine_settings(64 * 2**20)
    settings = replace(settings, batch=replace(settings.batch, batch_window_ms=1000))
    engine = Engine(loaded, settings)
    engine.start()
    try:
        def ttft(*agents: str) -> list[float]:
            results = run_turns(engine, [GenerationRequest(a, (BOS, *f"{a} says hi".encode()), 2) for a in agents])
            return [r.finish.usage.ttft_s for r in results]

        assert ttft("a")[0] >= 1.0  # a fresh engine expects a burst
        assert ttft("b")[0] < 0.5  # the last wake had no follower: a lone turn goes at once
        assert min(ttft("c", "d", "e")) >= 1.0  # three waiting at the wake: a burst, gathered whole
        assert ttft("f")[0] >= 1.0  # requests came together the last time: wait for more again
    finally:
        engine.stop()
