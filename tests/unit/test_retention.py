"""Anthropic cache_control breakpoints: parsed into a retention the engine honours when it
evicts, reported honestly in usage, visible in the agent API and the pool map."""

from __future__ import annotations

import time

import pytest

from engine.api.anthropic_schemas import MessagesRequest
from engine.api.retention import Retention, retention_of, usage_split
from engine.domain.block_pool import PoolSnapshot
from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.agents import AgentRecord, Tier
from semantic_tui.widgets.pool_map import KEPT_GLYPH, PoolView, render_pool
from tests.support.router_app import build_app, make_service
from tests.support.scripted_engine import ScriptedEngine

from .anthropic_helpers import body, client, sse_events

pytestmark = pytest.mark.unit

HOUR = {"type": "ephemeral", "ttl": "1h"}
FIVE_MINUTES = {"type": "ephemeral"}


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate(body("Hi", **fields))


def test_breakpoints_give_the_longest_ttl_and_where_the_last_one_is() -> None:
    assert retention_of(request()) is None
    tools = [{"name": "Read", "input_schema": {"type": "object"}, "cache_control": HOUR}]
    assert retention_of(request(tools=tools)) == Retention(3600.0, "head")
    system = [{"type": "text", "text": "Be brief.", "cache_control": FIVE_MINUTES}]
    assert retention_of(request(system=system)) == Retention(300.0, "head")
    marked = [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": FIVE_MINUTES}]}]
    assert retention_of(request(system=[{**system[0], "cache_control": HOUR}], messages=marked)) == Retention(
        3600.0, "messages")
    assert retention_of(request(cache_control=FIVE_MINUTES)) == Retention(300.0, "messages")


def test_the_usage_split_adds_up_to_the_prompt() -> None:
    # (input, cache creation, cache read)
    assert usage_split(100, 40, 0) == (60, 0, 40)  # no breakpoint: nothing is "created"
    assert usage_split(100, 40, 100) == (0, 60, 40)  # a breakpoint on the last message
    assert usage_split(100, 40, 70) == (30, 30, 40)  # a breakpoint after the system prompt
    assert usage_split(100, 80, 70) == (20, 0, 80)  # the marked head was read from the cache
    assert all(sum(usage_split(p, r, k)) == p for p in (1, 50, 300) for r in range(p) for k in (0, 10, p))


async def test_a_marked_request_is_retained_and_its_usage_counts_cache_creation(tmp_path) -> None:
    engine = ScriptedEngine(script=lambda r: "ok")
    app = build_app(make_service(tmp_path, engine))
    system = [{"type": "text", "text": "You are a careful agent. " * 20, "cache_control": HOUR}]
    first = body("Tell me a story", system=system, metadata={"user_id": "kept-agent"})
    async with client(app) as http:
        answer = (await http.post("/v1/messages", json=first)).json()
        sent = engine.requests[-1]
        assert sent.retain_s == 3600.0 and 0 < sent.retain_tokens == sent.head_tokens < len(sent.prompt_tokens)
        usage = answer["usage"]
        assert usage["cache_creation_input_tokens"] == sent.retain_tokens
        assert usage["input_tokens"] == len(sent.prompt_tokens) - sent.retain_tokens
        assert usage["cache_read_input_tokens"] == 0

        again = dict(first, stream=True, messages=first["messages"] + [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "Another", "cache_control": FIVE_MINUTES}]}])
        events = sse_events((await http.post("/v1/messages", json=again)).text)
        final = [d for n, d in events if n == "message_delta"][0]["usage"]
        sent = engine.requests[-1]
        assert sent.retain_tokens == len(sent.prompt_tokens)  # the breakpoint is on the last message
        assert final["cache_read_input_tokens"] > sent.head_tokens
        assert final["input_tokens"] == 0
        assert sum(final[k] for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")) \
            == len(sent.prompt_tokens)

        agents = (await http.get("/v1/agents")).json()["data"]
        kept = [a for a in agents if a["retained_s"] > 0]
        assert len(kept) == 1 and 3500 < kept[0]["retained_s"] <= 3600


async def test_a_bad_ttl_is_refused_naming_the_field(tmp_path) -> None:
    app = build_app(make_service(tmp_path, ScriptedEngine()))
    bad = body("Hi", system=[{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}])
    async with client(app) as http:
        response = await http.post("/v1/messages", json=bad)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "cache_control" in error["error"]["message"] and "ttl" in error["error"]["message"]


def hot(table: AgentTable, agent_id: str, retain_s: float = 0.0, auxiliary: bool = False) -> AgentRecord:
    record = table.add(AgentRecord(agent_id, tier=Tier.HOT, auxiliary=auxiliary))
    table.touch(record)
    record.retain(retain_s, time.monotonic())
    return record


def test_retained_agents_are_evicted_after_every_unmarked_one() -> None:
    table = AgentTable()
    hot(table, "kept", retain_s=3600)  # the least recently used
    hot(table, "plain-1")
    hot(table, "side", auxiliary=True)
    hot(table, "plain-2")
    expired = hot(table, "expired", retain_s=1)
    expired.retained_until = time.monotonic() - 1
    assert [a.agent_id for a in table.eviction_order(set())] == ["side", "plain-1", "plain-2", "expired", "kept"]
    # A preference, not a pin: with nothing else left, the retained agent can go.
    assert [a.agent_id for a in table.eviction_order({"side", "plain-1", "plain-2", "expired"})] == ["kept"]


def test_the_pool_map_draws_kept_blocks_and_says_so_in_its_legend() -> None:
    pool = PoolSnapshot(total_blocks=8, used_blocks=4, block_bytes=1024, n_groups=1, shared_blocks=0,
                        owner_blocks={"kept": 2, "plain": 2},
                        block_owner=("kept", "kept", "plain", "plain", None, None, None, None),
                        block_group=(0, 0, 0, 0, None, None, None, None))
    text = render_pool(PoolView(pool, frozenset(), (("kept", "kept"), ("plain", "plain")), frozenset({"kept"})),
                       40, 6).plain
    grid = text.splitlines()[2]
    assert grid.startswith(f"{KEPT_GLYPH} {KEPT_GLYPH} █ █ ·")
    assert f"{KEPT_GLYPH} kept" in text
    unmarked = render_pool(PoolView(pool, frozenset(), (("kept", "kept"), ("plain", "plain"))), 40, 6).plain
    assert KEPT_GLYPH not in unmarked
