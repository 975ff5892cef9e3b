"""max_output_seconds: a response that generates for too long ends as max_tokens would, and says why.

A small model on a CPU can take longer to write max_output_tokens than a
client waits (Claude Code abandons a request after 10 minutes and sends it
again); the server ends the response first, with what it generated so far.
"""

from __future__ import annotations

import time

import pytest
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.domain.requests import FinishReason, GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.settings import EngineSettings, Settings
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_engine_batching import prompt_for

pytestmark = pytest.mark.unit

BUDGET_S = 0.3


def started(max_output_s: float) -> Engine:
    # The tiny random llama repeats one token greedily; the repetition guard is off so only the budget ends it.
    config = engine_settings(64 << 20, 4, 32, repetition_window=0, max_output_seconds=max_output_s)
    engine = Engine(loaded_tiny("llama", context=1 << 16), config)
    engine.start()
    return engine


def test_a_response_past_the_budget_ends_on_its_time_limit_reported_as_max_tokens_with_a_note() -> None:
    engine = started(BUDGET_S)
    try:
        began = time.monotonic()
        result = run_turn(engine, GenerationRequest("slow", prompt_for(0), 50_000))
        took = time.monotonic() - began
        assert result.finish.reason is FinishReason.TIME_LIMIT and result.finish.reason.outcome == "length"
        assert 0 < result.finish.usage.generated_tokens < 50_000
        assert result.finish.note == "ended after 0.3 s of generating (max_output_seconds)"
        assert BUDGET_S <= took < 30
        agent = engine.fresh_snapshot().agent("slow")
        assert agent.last_finish == "time_limit" and agent.last_finish_note == result.finish.note
        # The cache holds everything generated: the next turn continues from it.
        follow = prompt_for(0) + tuple(result.tokens) + tuple(b" go on")
        nxt = run_turn(engine, GenerationRequest("slow", follow, 4))
        assert nxt.finish.usage.reused_tokens == len(prompt_for(0)) + len(result.tokens)
    finally:
        engine.stop()


def test_zero_turns_the_budget_off_and_settings_reach_the_engine() -> None:
    engine = started(0)
    try:
        result = run_turn(engine, GenerationRequest("free", prompt_for(0), 300))
        assert result.finish.reason is FinishReason.LENGTH and result.finish.note is None
        assert result.finish.usage.generated_tokens == 300
    finally:
        engine.stop()
    assert EngineSettings.of(Settings()).turns.max_output_seconds == 300.0
    assert EngineSettings.of(Settings(max_output_seconds=0)).turns.max_output_seconds == 0.0
