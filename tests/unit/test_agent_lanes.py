"""Lanes: concurrent requests that no client named run side by side as sibling agents (agent_lanes.py)."""

from __future__ import annotations

from engine.api.agent_lanes import AgentLanes


def test_the_first_free_lane_is_taken_and_a_released_one_is_taken_again() -> None:
    lanes = AgentLanes(most=3)
    assert [lanes.claim("m", "openai-ab", f"r{i}") for i in range(3)] == ["openai-ab", "openai-ab-2", "openai-ab-3"]
    lanes.release("r1")
    assert lanes.claim("m", "openai-ab", "r3") == "openai-ab-2"
    # Past the most lanes a turn queues behind the first lane's, as an agent's turns always did.
    assert lanes.claim("m", "openai-ab", "r4") == "openai-ab"
    for request in ("r0", "r2", "r3", "r4", "unknown"):
        lanes.release(request)
    assert lanes.held == 0 and lanes.claim("m", "openai-ab", "r5") == "openai-ab"


def test_lanes_are_per_model_and_per_agent() -> None:
    lanes = AgentLanes(most=4)
    assert lanes.claim("small", "openai-ab", "a") == "openai-ab"
    assert lanes.claim("large", "openai-ab", "b") == "openai-ab"
    assert lanes.claim("small", "openai-cd", "c") == "openai-cd"
    assert lanes.claim("small", "openai-ab", "d") == "openai-ab-2"
