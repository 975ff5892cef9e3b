"""Agent-aware scheduling on the real SmolLM2 and Gemma 3 (sliding window): a Claude Code-shaped burst (a main
agent's warm turn, subagents' prompts, one long prompt) gives every agent the same greedy tokens with priorities
and pacing on as with both off, and with them on the main agent's turn is answered before the long prompt's."""

from __future__ import annotations

import pytest

from engine.formats.rendering import PromptRenderer
from engine.domain.chat import ChatMessage, Conversation
from engine.domain.priority import AgentClass
from engine.domain.requests import GenerationRequest, SamplingParams, TokenEvent
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.sync_client import run_turn
from engine.settings import SchedulingSettings
from tests.model.engine_fixtures import start_engine
from tests.unit.test_agent_scheduling import Timeline

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)
SUBAGENTS = 3
OUT = 16


def chat(loaded, *turns: str) -> tuple[int, ...]:
    """User and assistant turns, alternating, rendered as the server renders them (the model's chat template, or
    the plain format of a GGUF without one) with the reply's opening."""
    messages = tuple(ChatMessage("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(turns))
    return tuple(PromptRenderer(loaded.tokenizer).render(Conversation(messages)))


def burst(loaded, opening: str, reply: str) -> list[GenerationRequest]:
    """The long prompt and the subagents first, the main agent's warm turn last (it arrives while they run)."""
    code = "def handler(event):\n    return event\n" * 60
    requests = [GenerationRequest("long-reader", chat(loaded, f"Summarise this file:\n{code}"), OUT, GREEDY,
                                  agent_class=AgentClass.SUBAGENT)]
    requests += [GenerationRequest(f"sub-{i}", chat(loaded, f"List the tests in module {i}. " * 12), OUT, GREEDY,
                                   agent_class=AgentClass.SUBAGENT) for i in range(SUBAGENTS)]
    requests.append(GenerationRequest("main", chat(loaded, opening, reply, "Which of the two is warmer?"), OUT,
                                      GREEDY, agent_class=AgentClass.MAIN))
    return requests


def served(loaded, scheduling: SchedulingSettings) -> tuple[dict[str, list[int]], Timeline]:
    engine: Engine = start_engine(loaded, batch=8, prefill_step=256, speculate="off", scheduling=scheduling)
    try:
        opening = "Name two colours, one warm and one cold."
        first = run_turn(engine, GenerationRequest("main", chat(loaded, opening), OUT, GREEDY,
                                                   agent_class=AgentClass.MAIN))
        timeline = Timeline()
        requests = burst(loaded, opening, first.text)
        for request in requests:
            timeline.submit(engine, request)
        for request in requests:
            finish = timeline.wait(request.agent_id, 300)
            assert finish.reason.value in ("stop", "length"), finish
        return {r.agent_id: timeline.tokens(r.agent_id) for r in requests}, timeline
    finally:
        engine.stop()


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_every_agent_gets_the_same_tokens_with_priorities_on_and_off(model: str, request) -> None:
    loaded = request.getfixturevalue(model)
    on, timeline = served(loaded, SchedulingSettings())
    off, _ = served(loaded, SchedulingSettings(priorities=False, decode_gap_ms=0))
    assert on == off
    assert all(on.values())
    assert timeline.first("main", TokenEvent) < timeline.first("long-reader", TokenEvent)
