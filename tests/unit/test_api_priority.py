"""Who an agent is and how urgent its turns are, through the HTTP API: classes read from the headers clients
already send, a priority from a body field or a header (a 400 naming the field when it is bad), the operator's
priority and pause endpoints, a tool call holding the agent's cache, and the per-class metrics."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from engine.domain.priority import DEFAULT_LEVELS, AgentClass
from tests.support.router_app import build_app, make_service
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.unit

SESSION = "5f0c8a9e-aaaa-bbbb-cccc-0123456789ab"
CLAUDE = {"x-claude-code-session-id": SESSION, "x-api-key": "sk-anything"}


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(lambda request: "ok")


def anthropic(max_tokens: int = 64, **extra: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello"}], **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], **extra}


async def test_claude_code_main_subagent_and_side_requests_get_their_classes(client: httpx.AsyncClient,
                                                                             engine: ScriptedEngine) -> None:
    for headers, body in ((CLAUDE, anthropic()),
                          ({**CLAUDE, "x-claude-code-agent-id": "agent-1"}, anthropic()),
                          (CLAUDE, anthropic(max_tokens=16, system="Write a title."))):
        response = await client.post("/v1/messages", json=body, headers=headers)
        assert response.status_code == 200, response.text
    main, sub, side = engine.requests
    assert (main.agent_class, sub.agent_class, side.agent_class) == (
        AgentClass.MAIN, AgentClass.SUBAGENT, AgentClass.SIDE)
    assert main.lineage.family == sub.lineage.family == side.lineage.family == f"cc-{SESSION}"


async def test_a_codex_sub_thread_groups_under_its_parent(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    codex = {"originator": "codex_exec", "user-agent": "codex_exec/0.130"}
    body = {"model": "gpt-5", "input": "hi", "store": False}
    await client.post("/v1/responses", json={**body, "prompt_cache_key": "root-thread"}, headers=codex)
    await client.post("/v1/responses", json={**body, "prompt_cache_key": "child-thread"},
                      headers={**codex, "x-codex-parent-thread-id": "root-thread", "x-openai-subagent": "collab_spawn"})
    root, child = engine.requests
    assert root.agent_class is AgentClass.MAIN and root.lineage.family == "codex-root-thread"
    assert child.agent_class is AgentClass.SUBAGENT and child.lineage.parent == "codex-root-thread"


@pytest.mark.parametrize("body, headers, level", [
    (chat(priority=1), {}, 1),
    (chat(priority="background"), {}, 6),
    (chat(priority=2), {"x-semantic-priority": "9"}, 2),  # the body's field first
    (chat(), {"x-semantic-priority": "4"}, 4),
    (chat(), {}, None),
])
async def test_openai_priority_from_the_body_or_the_header(client: httpx.AsyncClient, engine: ScriptedEngine,
                                                           body: dict, headers: dict, level: int | None) -> None:
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert engine.requests[-1].priority == level


async def test_anthropic_priority_in_metadata_and_a_script_that_says_it_is_background(
        client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    response = await client.post("/v1/messages", json=anthropic(metadata={"priority": 5}))
    assert response.status_code == 200, response.text
    assert engine.requests[-1].priority == 5
    response = await client.post("/v1/messages", json=anthropic(), headers={
        "x-semantic-agent-class": "background", "x-semantic-agent-name": "nightly"})
    assert response.status_code == 200, response.text
    assert engine.requests[-1].agent_class is AgentClass.BACKGROUND
    assert engine.requests[-1].display_name == "nightly"


@pytest.mark.parametrize("path, body, headers, field", [
    ("/v1/chat/completions", chat(priority=12), {}, "priority"),
    ("/v1/chat/completions", chat(), {"x-semantic-priority": "soon"}, "x-semantic-priority"),
    ("/v1/messages", anthropic(metadata={"priority": -1}), {}, "metadata.priority"),
    ("/v1/messages", anthropic(), {"x-semantic-agent-class": "boss"}, "x-semantic-agent-class"),
])
async def test_a_bad_priority_is_a_400_naming_its_field(client: httpx.AsyncClient, engine: ScriptedEngine,
                                                        path: str, body: dict, headers: dict, field: str) -> None:
    response = await client.post(path, json=body, headers=headers)
    assert response.status_code == 400, response.text
    assert field in response.text
    assert not engine.requests


@pytest.mark.parametrize("settings, key, level", [
    ({}, None, 1),  # no key: a client reaches main's level at most
    ({"open_priority_limit": 3}, None, 3),
    ({"open_priority_limit": 0}, None, 0),  # the limit turned off
    ({"api_key": "secret"}, "secret", 0),  # a request that showed the key is not limited
])
async def test_without_an_api_key_a_client_cannot_outrank_a_main_agent(tmp_path, engine: ScriptedEngine,
                                                                         settings: dict, key: str | None,
                                                                         level: int) -> None:
    app = build_app(make_service(tmp_path, engine, **settings))
    auth = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for body, headers in ((chat(priority=0), {}), (chat(), {"x-semantic-priority": "interactive"}),
                              (chat(), {"x-semantic-agent-class": "interactive"})):
            response = await client.post("/v1/chat/completions", json=body, headers={**headers, **auth})
            assert response.status_code == 200, response.text
            request = engine.requests[-1]
            asked = request.priority if request.priority is not None else DEFAULT_LEVELS[request.agent_class]
            assert asked == level, (body, headers)
        # a level less urgent than the limit is the client's to ask
        response = await client.post("/v1/chat/completions", json=chat(priority=5), headers=auth)
        assert engine.requests[-1].priority == 5


async def test_the_operator_sets_a_priority_and_pauses_an_agent(client: httpx.AsyncClient,
                                                                engine: ScriptedEngine) -> None:
    await client.post("/v1/chat/completions", json=chat(session_id="worker"))
    response = await client.post("/v1/agents/oa-worker/priority", json={"priority": "interactive"})
    assert response.status_code == 200, response.text
    assert response.json()["priority"] == 0 and response.json()["priority_set"]
    response = await client.post("/v1/agents/oa-worker/pause", json={"paused": True})
    assert response.status_code == 200 and response.json()["paused"]
    response = await client.post("/v1/agents/oa-worker/priority", json={"priority": 11})
    assert response.status_code == 400 and "priority" in response.text
    response = await client.post("/v1/agents/nobody/pause", json={"paused": True})
    assert response.status_code == 404


async def test_a_reply_that_calls_a_tool_holds_the_agents_cache(tmp_path, engine: ScriptedEngine) -> None:
    engine.script = lambda request: '<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>'
    app = build_app(make_service(tmp_path, engine, tool_loop_hold_s=120))
    tools = [{"name": "read", "description": "Read a file",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        response = await client.post("/v1/messages", json=anthropic(max_tokens=400, tools=tools), headers=CLAUDE)
        assert response.status_code == 200, response.text
        assert response.json()["stop_reason"] == "tool_use"
        agent = engine.agents[engine.requests[-1].agent_id]
        listed = (await client.get(f"/v1/agents/{agent.agent_id}")).json()
    assert listed["retained_s"] > 100
