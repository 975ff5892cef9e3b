"""The direct agent API and its conversation store, against a ScriptedEngine."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import quote

import httpx
import pytest
from fastapi import FastAPI

from engine.store.conversations import AgentConversation, ConversationStore
from engine.domain.agent_ids import AGENT_ID
from engine.api.service import EngineService
from engine.store.file_names import agent_file_stem
from tests.support.engine_faults import POOL_MESSAGE, BusyEngine, FailsMidStreamEngine, PoolExhaustedEngine
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine

BAD_IDS = ["../etc", "a b", "x" * 200, "", "café", "日本語", "..", "-lead", "a/b", "nul\x00"]


def reply_for(request: Any) -> str:
    return f"reply {len(request.prompt_tokens)}"


def events(body: str) -> list[tuple[str, Any]]:
    """(event name, data) pairs of an SSE body; comments become (":", None)."""
    out: list[tuple[str, Any]] = []
    for block in filter(None, body.split("\n\n")):
        if block.startswith(":"):
            out.append((":", None))
            continue
        name_line, data_line = block.split("\n")
        out.append((name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))))
    return out


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(reply_for)




async def create(client: httpx.AsyncClient, agent_id: str = "bob", **fields: Any) -> dict[str, Any]:
    response = await client.post("/v1/agents", json={"agent_id": agent_id, **fields})
    assert response.status_code == 201, response.text
    return response.json()


def conversation_file(tmp_path: Path, agent_id: str) -> Path:
    return tmp_path / "conversations" / f"{agent_file_stem(agent_id)}.json"


# -- create, list, get -------------------------------------------------------------------------------
async def test_create_agent(client: httpx.AsyncClient, tmp_path: Path) -> None:
    body = await create(client, "bob", system="Be brief.", display_name="Bob")
    assert body["agent_id"] == "bob" and body["display_name"] == "Bob"
    assert (body["tier"], body["state"], body["source"], body["messages"], body["cached_tokens"]) == ("empty", "idle", "api", 0, 0)
    stored = json.loads(conversation_file(tmp_path, "bob").read_text())
    assert (stored["agent_id"], stored["system"], stored["messages"]) == ("bob", "Be brief.", [])


async def test_create_generates_an_id_and_rejects_duplicates(client: httpx.AsyncClient) -> None:
    generated = (await client.post("/v1/agents", json={})).json()["agent_id"]
    assert AGENT_ID.match(generated)
    duplicate = await client.post("/v1/agents", json={"agent_id": generated})
    assert duplicate.status_code == 409 and "already exists" in duplicate.json()["error"]["message"]


async def test_create_rejects_an_id_the_engine_already_has(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "session_id": "s"})
    assert (await client.post("/v1/agents", json={"agent_id": "oa-s"})).status_code == 409


async def test_list_merges_engine_and_store(client: httpx.AsyncClient) -> None:
    await create(client, "talker")
    await client.post("/v1/agents/talker/messages", json={"content": "hi"})
    await create(client, "quiet")
    await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "session_id": "s"})
    listing = (await client.get("/v1/agents")).json()
    assert listing["object"] == "list"
    agents = {a["agent_id"]: a for a in listing["data"]}
    assert set(agents) == {"talker", "quiet", "oa-s"}
    assert (agents["talker"]["tier"], agents["talker"]["turns"], agents["talker"]["messages"]) == ("hot", 1, 2)
    assert agents["talker"]["blocks"] > 0 and agents["talker"]["bytes"] > 0
    assert (agents["quiet"]["tier"], agents["quiet"]["has_conversation"]) == ("empty", True)
    assert (agents["oa-s"]["source"], agents["oa-s"]["has_conversation"]) == ("openai", False)
    expected = {"agent_id", "display_name", "source", "state", "tier", "pinned", "cached_tokens", "blocks", "bytes",
                "turns", "reuse_ratio", "last_ttft_s", "decode_tok_s", "last_used", "last_finish", "last_finish_note",
                "retained_s", "messages", "has_conversation", "checkpoint_bytes", "state_bytes", "speculation",
                "last_reasoning_tokens", "model", "agent_class", "family", "parent", "priority", "priority_set",
                "paused", "queue_position", "waiting_on_tool"}
    assert all(set(a) == expected for a in agents.values())


async def test_get_unknown_agent_is_404(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/agents/nobody")
    assert response.status_code == 404
    assert response.json() == {"type": "error", "error": {"type": "not_found_error", "message": "agent 'nobody' does not exist"}}


# -- stateful turns ----------------------------------------------------------------------------------
async def test_turns_extend_the_stored_history(client: httpx.AsyncClient, engine: ScriptedEngine, tmp_path: Path) -> None:
    await create(client, "bob", system="Be brief.")
    first = (await client.post("/v1/agents/bob/messages", json={"content": "Hi"})).json()
    decode = engine.loaded.tokenizer.decode
    assert decode(list(engine.requests[0].prompt_tokens)) == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert first == {"agent_id": "bob", "content": "reply 40", "reasoning": "", "finish_reason": "stop", "usage": {
        "prompt_tokens": 40, "reused_tokens": 0, "prefilled_tokens": 40, "generated_tokens": 8, "reasoning_tokens": 0,
        "ttft_s": 0.001, "decode_tok_s": 100.0}}
    second = (await client.post("/v1/agents/bob/messages", json={"content": "More"})).json()
    assert decode(list(engine.requests[1].prompt_tokens)) == (
        "System: Be brief.\n\nUser: Hi\n\nAssistant: reply 40\n\nUser: More\n\nAssistant:")
    assert second["usage"]["reused_tokens"] == 40
    assert engine.requests[1].agent_id == "bob" and engine.requests[1].source.value == "api"
    stored = json.loads(conversation_file(tmp_path, "bob").read_text())["messages"]
    assert stored == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "reply 40"},
                      {"role": "user", "content": "More"}, {"role": "assistant", "content": second["content"]}]
    assert (await client.get("/v1/agents/bob")).json()["messages"] == 4


async def test_turn_options_reach_the_engine(client: httpx.AsyncClient, engine: ScriptedEngine, service: EngineService) -> None:
    await create(client, "bob")
    await client.post("/v1/agents/bob/messages", json={"content": "Hi"})
    assert engine.requests[-1].max_tokens == service.settings.default_max_tokens
    # No temperature: the model's sampling defaults (the scripted model has no generation_config.json).
    assert engine.requests[-1].sampling.temperature == 0.7
    body = (await client.post("/v1/agents/bob/messages",
                              json={"content": "Hi", "max_tokens": 3, "temperature": 0.5, "stop": "x"})).json()
    assert (body["content"], body["finish_reason"]) == ("rep", "length")
    assert engine.requests[-1].sampling.temperature == 0.5 and engine.requests[-1].stop_strings == ("x",)


async def test_message_to_an_agent_without_conversation_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/agents/ghost/messages", json={"content": "Hi"})
    assert response.status_code == 404 and "POST /v1/agents" in response.json()["error"]["message"]


@pytest.mark.parametrize("body", [{}, {"content": ""}, {"content": "x", "temperature": -1}, {"content": "x", "max_tokens": 0}])
async def test_invalid_message_bodies_are_400(client: httpx.AsyncClient, body: dict) -> None:
    await create(client, "bob")
    assert (await client.post("/v1/agents/bob/messages", json=body)).status_code == 400


async def test_streamed_turn(client: httpx.AsyncClient, tmp_path: Path) -> None:
    await create(client, "bob")
    response = await client.post("/v1/agents/bob/messages", json={"content": "Hi", "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    stream = events(response.text)
    assert [name for name, _ in stream] == ["token"] * len("reply 21") + ["done"]
    assert "".join(data["text"] for name, data in stream if name == "token") == "reply 21"
    done = stream[-1][1]
    assert (done["agent_id"], done["content"], done["finish_reason"]) == ("bob", "reply 21", "stop")
    assert len(json.loads(conversation_file(tmp_path, "bob").read_text())["messages"]) == 2


async def test_failed_turn_leaves_history_alone(tmp_path: Path) -> None:
    engine = ScriptedEngine(reply_for, fail_with="boom")
    app = build_app(make_service(tmp_path, engine))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        await create(http, "bob")
        failed = await http.post("/v1/agents/bob/messages", json={"content": "Hi"})
        assert failed.status_code == 500 and failed.json()["error"]["message"] == "generation failed: boom"
        engine.fail_with = None
        assert (await http.post("/v1/agents/bob/messages", json={"content": "Hi"})).status_code == 200
        assert (await http.get("/v1/agents/bob")).json()["messages"] == 2


async def test_mid_stream_failure_is_an_error_event_and_not_recorded(tmp_path: Path) -> None:
    app = build_app(make_service(tmp_path, FailsMidStreamEngine()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        await create(http, "bob")
        response = await http.post("/v1/agents/bob/messages", json={"content": "Hi", "stream": True})
        assert response.status_code == 200
        stream = events(response.text)
        assert stream[-1] == ("error", {"type": "error", "error": {
            "type": "api_error", "message": "generation failed: engine step failed: boom"}})
        assert "".join(d["text"] for name, d in stream if name == "token") == "partial"
        assert (await http.get("/v1/agents/bob")).json()["messages"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_pool_exhaustion_is_429(tmp_path: Path, stream: bool) -> None:
    app = build_app(make_service(tmp_path, PoolExhaustedEngine()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        await create(http, "bob")
        response = await http.post("/v1/agents/bob/messages", json={"content": "Hi", "stream": stream})
        assert response.status_code == 429 and response.headers["retry-after"] == "2"
        assert response.json()["error"] == {"type": "rate_limit_error", "message": POOL_MESSAGE}
        assert (await http.get("/v1/agents/bob")).json()["messages"] == 0


async def test_one_turn_at_a_time_per_agent(tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda request: "slow reply", token_delay_s=0.03)
    app = build_app(make_service(tmp_path, engine))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        await create(http, "bob")
        first = asyncio.create_task(http.post("/v1/agents/bob/messages", json={"content": "one"}))
        while not app.state.conversations.is_busy("bob"):
            await asyncio.sleep(0.005)
        busy = await http.post("/v1/agents/bob/messages", json={"content": "two"})
        assert busy.status_code == 409
        assert (await http.delete("/v1/agents/bob")).status_code == 409
        assert (await first).status_code == 200
        after = await http.post("/v1/agents/bob/messages", json={"content": "two", "stream": True})
        assert after.status_code == 200 and (await http.get("/v1/agents/bob")).json()["messages"] == 4


async def test_metrics_count_agent_turns(client: httpx.AsyncClient, app: FastAPI) -> None:
    await create(client, "bob")
    await client.post("/v1/agents/bob/messages", json={"content": "Hi"})
    await client.post("/v1/agents/bob/messages", json={"content": "Hi", "stream": True})
    value = app.state.metrics.registry.get_sample_value("semantic_requests_total", {"protocol": "agents", "outcome": "stop"})
    assert value == 2


def test_stream_disconnect_cancels_and_records_nothing(tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda request: "z" * 500, token_delay_s=0.01)
    app = build_app(make_service(tmp_path, engine))
    with LiveServer(app) as server, httpx.Client(base_url=server.url) as http:
        assert http.post("/v1/agents", json={"agent_id": "bob"}).status_code == 201
        with http.stream("POST", "/v1/agents/bob/messages", json={"content": "Hi", "stream": True}) as response:
            assert next(response.iter_lines()) == "event: token"
        for _ in range(150):
            if engine.requests[-1].request_id in engine.cancelled and not app.state.conversations.is_busy("bob"):
                break
            time.sleep(0.02)
        assert engine.requests[-1].request_id in engine.cancelled
        assert http.get("/v1/agents/bob").json()["messages"] == 0


# -- delete, evict, pin --------------------------------------------------------------------------------
async def test_delete_frees_blocks_and_files(client: httpx.AsyncClient, engine: ScriptedEngine, tmp_path: Path) -> None:
    await create(client, "bob")
    await client.post("/v1/agents/bob/messages", json={"content": "Hi"})
    assert engine.pool.owned_blocks("bob") > 0
    response = await client.delete("/v1/agents/bob")
    assert response.status_code == 200 and response.json() == {"agent_id": "bob", "deleted": True}
    assert engine.pool.owned_blocks("bob") == 0 and "bob" not in engine.agents
    assert not conversation_file(tmp_path, "bob").exists()
    assert (await client.delete("/v1/agents/bob")).status_code == 404
    assert (await client.get("/v1/agents/bob")).status_code == 404


async def test_delete_of_a_busy_engine_agent_is_503(tmp_path: Path) -> None:
    app = build_app(make_service(tmp_path, BusyEngine(reply_for)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        await create(http, "bob")
        await http.post("/v1/agents/bob/messages", json={"content": "Hi"})
        response = await http.delete("/v1/agents/bob")
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert (await http.get("/v1/agents/bob")).json()["messages"] == 2  # the conversation survives


async def test_evict_and_pin(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    await create(client, "bob")
    await client.post("/v1/agents/bob/messages", json={"content": "Hi"})
    pinned = await client.post("/v1/agents/bob/pin", json={"pinned": True})
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True and engine.agents["bob"].pinned
    warm = (await client.post("/v1/agents/bob/evict")).json()
    assert (warm["tier"], warm["blocks"]) == ("warm", 0)
    assert (await client.post("/v1/agents/bob/evict", json={"tier": "cold"})).json()["tier"] == "cold"
    assert (await client.post("/v1/agents/bob/pin", json={"pinned": False})).json()["pinned"] is False
    assert (await client.post("/v1/agents/bob/evict", json={"tier": "hot"})).status_code == 400
    assert (await client.post("/v1/agents/bob/pin", json={})).status_code == 400


async def test_evict_and_pin_before_the_first_turn(client: httpx.AsyncClient) -> None:
    await create(client, "new")
    evicted = await client.post("/v1/agents/new/evict", json={"tier": "cold"})
    assert evicted.status_code == 200 and evicted.json()["tier"] == "empty"
    assert (await client.post("/v1/agents/new/pin", json={"pinned": True})).status_code == 409
    assert (await client.post("/v1/agents/nobody/evict")).status_code == 404


# -- agent ids -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", BAD_IDS)
async def test_bad_ids_in_bodies_are_400(client: httpx.AsyncClient, bad: str, tmp_path: Path) -> None:
    response = await client.post("/v1/agents", json={"agent_id": bad})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert not (tmp_path / "conversations").exists()


@pytest.mark.parametrize("bad", BAD_IDS)
async def test_bad_ids_in_urls_never_reach_anything(client: httpx.AsyncClient, bad: str, tmp_path: Path) -> None:
    # Dots encoded too, so no client-side dot-segment normalisation hides them.
    path = f"/v1/agents/{quote(bad, safe='').replace('.', '%2E')}"
    calls = [("GET", path, None), ("DELETE", path, None), ("POST", f"{path}/messages", {"content": "x"}),
             ("POST", f"{path}/evict", {}), ("POST", f"{path}/pin", {"pinned": True})]
    for method, url, body in calls:
        response = await client.request(method, url, json=body)
        # A decoded "/" or an empty id cannot match the route at all (404, 405, or
        # the trailing-slash redirect); every other id reaches validation.
        expected = {400} if bad and "/" not in bad else {307, 400, 404, 405}
        assert response.status_code in expected, (method, url, response.status_code)
    assert not (tmp_path / "conversations").exists()


# -- the store itself ----------------------------------------------------------------------------------
def test_store_persists_atomically_and_reloads_lazily(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    store.create("bob", "sys", "Bob")
    store.record_turn("bob", "hi \ud800 ü", "hello")
    assert [p.name for p in tmp_path.iterdir()] == [f"{agent_file_stem('bob')}.json"]  # no temp files left
    again = ConversationStore(tmp_path)
    loaded = again.get("bob")
    assert loaded is not None and (loaded.system, loaded.display_name) == ("sys", "Bob")
    assert [(m.role, m.content) for m in loaded.messages] == [("user", "hi \ud800 ü"), ("assistant", "hello")]
    assert [c.agent_id for c in again.all()] == ["bob"]
    assert again.delete("bob") and not again.delete("bob") and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [
    b"{not json", b"\xff\xfe", b"[]", b'{"version": 2}',
    json.dumps({**AgentConversation("bob").to_json(), "messages": [{"role": "system", "content": "x"}]}).encode(),
    json.dumps({**AgentConversation("bob").to_json(), "created_at": "yesterday"}).encode(),
    json.dumps(AgentConversation("alice").to_json()).encode(),  # another agent's record under bob's name
], ids=["not-json", "not-utf8", "a-list", "version-2", "system-message", "bad-created-at", "another-agent"])
def test_corrupt_files_are_skipped_with_a_warning(tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / f"{agent_file_stem('bob')}.json").write_bytes(content)
    store = ConversationStore(tmp_path)
    store.create("carol", None, None)
    with caplog.at_level(logging.WARNING, logger="semantic.api"):
        assert store.get("bob") is None
        assert [c.agent_id for c in ConversationStore(tmp_path).all()] == ["carol"]
    assert "ignoring" in caplog.text


async def test_conversations_survive_a_restart(tmp_path: Path) -> None:
    for expected in (0, 2):
        app = build_app(make_service(tmp_path, ScriptedEngine(reply_for)))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
            if expected == 0:
                await create(http, "bob", system="Be brief.")
                await http.post("/v1/agents/bob/messages", json={"content": "Hi"})
            else:
                agent = (await http.get("/v1/agents/bob")).json()
                assert (agent["messages"], agent["tier"]) == (2, "empty")
                assert [a["agent_id"] for a in (await http.get("/v1/agents")).json()["data"]] == ["bob"]


# -- a change that is made is reported as made ---------------------------------------------------------
class GoesAwayAfterChanges(ScriptedEngine):
    """An engine that a swap takes away (or that stops) right after it applied a change: the request's
    fresh snapshot can no longer be had."""

    service: EngineService | None = None

    def _gone(self) -> None:
        assert self.service is not None
        self.service.detach()

    def rewind_agent(self, *args: Any, **kwargs: Any):
        branch = super().rewind_agent(*args, **kwargs)
        self._gone()
        return branch

    def evict_agent(self, *args: Any, **kwargs: Any) -> None:
        super().evict_agent(*args, **kwargs)
        self._gone()


class CannotPublish(ScriptedEngine):
    """An engine stopping: its change ran, publishing a snapshot afterwards fails."""

    def publish_now(self):
        from engine.errors import EngineUnavailableError

        raise EngineUnavailableError("engine is not running", retry_after_s=5)


@asynccontextmanager
async def bob_after_turns(tmp_path: Path, kind: type, turns: tuple[str, ...]) -> AsyncIterator[httpx.AsyncClient]:
    """A client of an app over ``kind`` of engine, agent "bob" created and ``turns`` sent."""
    engine = kind(reply_for)
    service = make_service(tmp_path, engine)
    engine.service = service
    async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(service)), base_url="http://test") as http:
        await create(http, "bob")
        for text in turns:
            assert (await http.post("/v1/agents/bob/messages", json={"content": text})).status_code == 200
        yield http


@pytest.mark.parametrize("kind", [GoesAwayAfterChanges, CannotPublish])
async def test_a_rewind_that_happened_is_never_reported_as_a_retryable_error(tmp_path: Path, kind: type) -> None:
    # Found by the crash harness (bench/crash.py): a swap starting between a rewind's engine work and its
    # answer made the answer a 503 while the conversation was already cut, and the client, told to retry,
    # went on with the uncut history.
    async with bob_after_turns(tmp_path, kind, ("Hi", "More")) as http:
        rewound = await http.post("/v1/agents/bob/rewind", json={"turn": 1})
        assert rewound.status_code == 200, rewound.text
        assert rewound.json()["messages"] == 2
    stored = json.loads(conversation_file(tmp_path, "bob").read_text())["messages"]
    assert [m["content"] for m in stored] == ["Hi", "reply 21"]  # no system prompt: a 21-token prompt


@pytest.mark.parametrize("kind", [GoesAwayAfterChanges, CannotPublish])
async def test_an_eviction_that_happened_is_answered_with_the_agent(tmp_path: Path, kind: type) -> None:
    async with bob_after_turns(tmp_path, kind, ("Hi",)) as http:
        evicted = await http.post("/v1/agents/bob/evict")
        assert evicted.status_code == 200, evicted.text
        assert evicted.json()["agent_id"] == "bob" and evicted.json()["messages"] == 2
