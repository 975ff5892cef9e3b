"""Lanes: concurrent requests that no client named run side by side as sibling agents (agent_lanes.py)."""

from __future__ import annotations

from engine.api.agent_lanes import AgentLanes


async def test_the_first_free_lane_is_taken_and_a_released_one_is_taken_again() -> None:
    lanes = AgentLanes(most=3)
    assert [await lanes.claim("m", "openai-ab", f"r{i}") for i in range(3)] == [
        "openai-ab", "openai-ab-2", "openai-ab-3"]
    lanes.release("r1")
    assert await lanes.claim("m", "openai-ab", "r3") == "openai-ab-2"
    # Past the most lanes a turn queues behind the first lane's, as an agent's turns always did.
    assert await lanes.claim("m", "openai-ab", "r4") == "openai-ab"
    for request in ("r0", "r2", "r3", "r4", "unknown"):
        lanes.release(request)
    assert lanes.held == 0 and await lanes.claim("m", "openai-ab", "r5") == "openai-ab"


async def test_lanes_are_per_model_and_per_agent() -> None:
    lanes = AgentLanes(most=4)
    assert await lanes.claim("small", "openai-ab", "a") == "openai-ab"
    assert await lanes.claim("large", "openai-ab", "b") == "openai-ab"
    assert await lanes.claim("small", "openai-cd", "c") == "openai-cd"
    assert await lanes.claim("small", "openai-ab", "d") == "openai-ab-2"


async def test_a_lane_whose_client_went_away_is_taken_by_the_next_request() -> None:
    """A client that gave up and asks again at once queues behind its cancelled turn, on its own agent."""
    gone = {"r0": False}

    async def client_gone() -> bool:
        return gone["r0"]

    lanes = AgentLanes(most=4)
    assert await lanes.claim("m", "openai-ab", "r0", client_gone) == "openai-ab"
    assert await lanes.claim("m", "openai-ab", "r1") == "openai-ab-2"  # r0's client is still there
    lanes.release("r1")
    gone["r0"] = True
    assert await lanes.claim("m", "openai-ab", "r2") == "openai-ab"
