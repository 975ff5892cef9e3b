"""Lanes: concurrent requests that no client named run side by side as sibling agents (agent_lanes.py)."""

from __future__ import annotations

import asyncio

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


async def test_a_busy_lane_is_looked_at_again_before_a_sibling_is_started() -> None:
    """A disconnect is seen only a loop turn or two after the first check resumed reading (uvicorn): the
    claim waits that long, so a client that dropped its request and sent the next at once keeps its agent."""
    checks = {"r0": 0}

    async def seen_on_second_check() -> bool:
        checks["r0"] += 1
        return checks["r0"] > 1

    lanes = AgentLanes(most=4)
    assert await lanes.claim("m", "openai-ab", "r0", seen_on_second_check) == "openai-ab"
    checks["r0"] = 0
    assert await lanes.claim("m", "openai-ab", "r1") == "openai-ab"
    assert lanes.held == 2


async def test_concurrent_claims_that_wait_take_distinct_lanes() -> None:
    lanes = AgentLanes(most=4)
    assert await lanes.claim("m", "openai-ab", "r0") == "openai-ab"
    taken = await asyncio.gather(*(lanes.claim("m", "openai-ab", f"r{i}") for i in range(1, 4)))
    assert sorted(taken) == ["openai-ab-2", "openai-ab-3", "openai-ab-4"]


async def test_a_request_whose_client_is_gone_starts_no_lane() -> None:
    async def gone() -> bool:
        return True

    lanes = AgentLanes(most=4)
    assert await lanes.claim("m", "openai-ab", "r0") == "openai-ab"
    assert await lanes.claim("m", "openai-ab", "r1", gone) == "openai-ab"


async def test_a_claim_cancelled_while_it_waits_holds_nothing() -> None:
    lanes = AgentLanes(most=4)
    await lanes.claim("m", "openai-ab", "r0")
    waiting = asyncio.ensure_future(lanes.claim("m", "openai-ab", "r1"))
    await asyncio.sleep(0)
    waiting.cancel()
    try:
        await waiting
    except asyncio.CancelledError:
        pass
    assert lanes.held == 1
    assert await lanes.claim("m", "openai-ab", "r2") == "openai-ab-2"
