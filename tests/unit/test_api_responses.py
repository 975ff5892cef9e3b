"""The Responses API (POST /v1/responses and stored responses) against a ScriptedEngine:
items to prompts, the response object, the typed SSE events, previous_response_id, Codex's
requests, errors that store nothing, a restart, and the official SDK on a real socket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from engine.api.service import EngineService
from engine.domain.requests import AgentSource
from tests.support.engine_faults import PoolExhaustedEngine
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded

URL = "/v1/responses"
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather by city", "strict": True,
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# What Codex CLI 0.171 sends beside its function tools (platform.md): a hosted tool nothing here can run.
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
CODEX_HEADERS = {"originator": "codex_exec", "user-agent": "codex_exec/0.171.0 (Debian 12; x86_64)"}


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(lambda request: "Hello there.")


def prompt_text(engine: ScriptedEngine, index: int = -1) -> str:
    return engine.loaded.tokenizer.decode(list(engine.requests[index].prompt_tokens))


def events(body: str) -> list[dict[str, Any]]:
    """The SSE events of a streamed response; each ``event:`` line must name its data's type."""
    out = []
    for block in filter(None, body.split("\n\n")):
        if block.startswith(":"):
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def stored_files(service: EngineService) -> list[Path]:
    return sorted((service.settings.cache_dir / "responses").glob("*.json"))


# -- the response object ----------------------------------------------------------------------------
async def test_response_shape(client: httpx.AsyncClient) -> None:
    response = await client.post(URL, json={"model": "gpt-5", "input": "Hi"})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["status"] == "completed"
    assert body["model"] == "gpt-5" and body["incomplete_details"] is None and body["error"] is None
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "Hello there.", "annotations": [], "logprobs": []}]
    usage = body["usage"]
    assert usage["output_tokens"] == len("Hello there.") and usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert response.headers["x-semantic-agent-id"] == body["agent_id"]


async def test_items_render_into_the_prompt(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Look:"}, {"type": "input_file", "file_id": "f"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
    ]
    body = {"input": items, "instructions": "Be brief.", "tools": [WEATHER_TOOL, WEB_SEARCH],
            "metadata": {"trace": "meta-never-rendered"}, "client_metadata": {"turn_started_at_unix_ms": "1795910821"},
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"]}
    assert (await client.post(URL, json=body)).status_code == 200
    prompt = prompt_text(engine)
    assert prompt.startswith("System: Be brief.")
    assert "Use tools." in prompt and "User: Look:\n[file]" in prompt
    assert 'Assistant: Checking.\n<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}' in prompt
    assert prompt.endswith("User: <tool_response>\n18C\n</tool_response>\n\nAssistant:")
    assert '"name": "get_weather"' in prompt and "web_search" not in prompt
    assert "gAAAA" not in prompt and "never-rendered" not in prompt and "1795910821" not in prompt


async def test_tool_call_comes_back_as_a_function_call_item(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.script = lambda request: WEATHER_CALL
    body = (await client.post(URL, json={"input": "Weather?", "tools": [WEATHER_TOOL]})).json()
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["status"] == "completed" and call["id"].startswith("fc_")
    assert call["call_id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert body["status"] == "completed"


async def test_max_output_tokens_is_incomplete(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    body = (await client.post(URL, json={"input": "Hi", "max_output_tokens": 3})).json()
    assert engine.requests[-1].max_tokens == 3
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "Hel" and body["output"][0]["status"] == "incomplete"


async def test_sampling_fields_are_passed_on(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    await client.post(URL, json={"input": "Hi", "temperature": 0.3, "top_p": 0.8})
    assert (engine.requests[-1].sampling.temperature, engine.requests[-1].sampling.top_p) == (0.3, 0.8)
    await client.post(URL, json={"input": "Hi"})  # left out: the model's defaults
    assert (engine.requests[-1].sampling.temperature, engine.requests[-1].sampling.top_p) == (0.7, 0.95)


# -- state: previous_response_id and stored responses ----------------------------------------------------
async def test_previous_response_id_continues_the_same_agent(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    first = (await client.post(URL, json={"input": "Hi", "instructions": "Be brief."})).json()
    second = (await client.post(URL, json={"input": "More", "previous_response_id": first["id"],
                                           "instructions": "Be brief."})).json()
    third = (await client.post(URL, json={"input": "Again", "previous_response_id": second["id"],
                                          "instructions": "Be brief."})).json()
    assert {r.agent_id for r in engine.requests} == {first["agent_id"]} and first["agent_id"].startswith("responses-")
    assert prompt_text(engine, 2).startswith(prompt_text(engine, 1)[:-len("Assistant:")])
    assert "Assistant: Hello there.\n\nUser: More\n\nAssistant: Hello there.\n\nUser: Again" in prompt_text(engine, 2)
    # The scripted cache holds each prompt and its reply: the whole previous prompt is reused.
    assert third["usage"]["input_tokens_details"]["cached_tokens"] == len(engine.requests[1].prompt_tokens)
    assert third["previous_response_id"] == second["id"]


async def test_instructions_are_not_carried_over(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    first = (await client.post(URL, json={"input": "Hi", "instructions": "Speak French."})).json()
    await client.post(URL, json={"input": "More", "previous_response_id": first["id"]})
    assert "Speak French." not in prompt_text(engine)


async def test_stored_response_get_input_items_delete(client: httpx.AsyncClient, service: EngineService) -> None:
    created = (await client.post(URL, json={"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                                      {"role": "user", "content": "c"}]})).json()
    rid = created["id"]
    assert (await client.get(f"{URL}/{rid}")).json() == created
    listed = (await client.get(f"{URL}/{rid}/input_items")).json()
    assert listed["object"] == "list" and not listed["has_more"]
    assert [i["content"][0]["text"] for i in listed["data"]] == ["c", "b", "a"]  # newest first, as the API lists
    page = (await client.get(f"{URL}/{rid}/input_items", params={"order": "asc", "limit": 2})).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["a", "b"] and page["has_more"]
    rest = (await client.get(f"{URL}/{rid}/input_items", params={"order": "asc", "after": page["last_id"]})).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["c"]
    assert (await client.delete(f"{URL}/{rid}")).json() == {"id": rid, "object": "response", "deleted": True}
    for response in (await client.get(f"{URL}/{rid}"), await client.delete(f"{URL}/{rid}"),
                     await client.post(URL, json={"input": "x", "previous_response_id": rid})):
        assert response.status_code == 404 and response.json()["error"]["type"] == "invalid_request_error"
    assert stored_files(service) == []


async def test_store_false_keeps_nothing(client: httpx.AsyncClient, service: EngineService) -> None:
    body = (await client.post(URL, json={"input": "Hi", "store": False})).json()
    assert body["store"] is False and (await client.get(f"{URL}/{body['id']}")).status_code == 404
    assert stored_files(service) == []


async def test_stored_responses_survive_a_restart(tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda request: "Hello there.")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(make_service(tmp_path, engine))),
                                 base_url="http://t") as http:
        first = (await http.post(URL, json={"input": "Hi"})).json()
    restarted = ScriptedEngine(lambda request: "Hello there.")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(make_service(tmp_path, restarted))),
                                 base_url="http://t") as http:
        assert (await http.get(f"{URL}/{first['id']}")).json() == first
        second = (await http.post(URL, json={"input": "More", "previous_response_id": first["id"]})).json()
    assert second["agent_id"] == first["agent_id"]
    assert restarted.requests[0].prompt_tokens[:len(engine.requests[0].prompt_tokens)] == engine.requests[0].prompt_tokens


async def test_the_oldest_stored_responses_go_past_the_limit(tmp_path: Path) -> None:
    service = make_service(tmp_path, ScriptedEngine(lambda request: "ok"), stored_responses_kept=3)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(service)), base_url="http://t") as http:
        ids = [(await http.post(URL, json={"input": f"q{i}"})).json()["id"] for i in range(5)]
        found = [(await http.get(f"{URL}/{rid}")).status_code for rid in ids]
    assert len(stored_files(service)) == 3 and found[-1] == 200 and found.count(404) == 2


# -- agents: prompt_cache_key and Codex --------------------------------------------------------------
async def test_codex_turns_find_their_agent_by_prompt_cache_key(client: httpx.AsyncClient, engine: ScriptedEngine,
                                                              service: EngineService) -> None:
    thread = "019a78e7-f0c7-7e51-840f-580cd7992d50"
    developer = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]}
    turn = {"model": "gpt-5-codex", "instructions": "", "store": False, "stream": False, "prompt_cache_key": thread,
            "tools": [WEATHER_TOOL, WEB_SEARCH], "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"]}
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]}
    first = (await client.post(URL, json={**turn, "input": [developer, user],
                                          "client_metadata": {"turn_started_at_unix_ms": "1"}},
                               headers=CODEX_HEADERS)).json()
    reply = first["output"][0]
    nxt = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now count them."}]}
    second = (await client.post(URL, json={**turn, "input": [developer, user, reply, nxt],
                                           "client_metadata": {"turn_started_at_unix_ms": "2"}},
                                headers=CODEX_HEADERS)).json()
    assert first["agent_id"] == second["agent_id"] == f"codex-{thread}"
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == len(engine.requests[0].prompt_tokens)
    assert stored_files(service) == []
    assert engine.requests[-1].source is AgentSource.CODEX and engine.requests[-1].display_name == "Codex 019a78e7"


async def test_a_key_that_is_not_an_id_is_hashed(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    await client.post(URL, json={"input": "Hi", "prompt_cache_key": "user 42 / project x"})
    await client.post(URL, json={"input": "Yo", "prompt_cache_key": "user 42 / project x"})
    (agent,) = {r.agent_id for r in engine.requests}
    assert agent.startswith("rs-") and len(agent) == len("rs-") + 16


# -- streaming ----------------------------------------------------------------------------------------
async def test_stream_event_order(client: httpx.AsyncClient, service: EngineService) -> None:
    response = await client.post(URL, json={"input": "Hi", "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    data = events(response.text)
    kinds = [e["type"] for e in data]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert data[0]["response"]["status"] == "in_progress" and data[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in data if e["type"] == "response.output_text.delta") == "Hello there."
    assert data[-4]["text"] == data[-3]["part"]["text"] == "Hello there." and data[-2]["item"]["status"] == "completed"
    completed = data[-1]["response"]
    assert completed["status"] == "completed" and completed["output"] == [data[-2]["item"]]
    assert (await client.get(f"{URL}/{completed['id']}")).json() == completed


async def test_stream_text_then_tool_call(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.script = lambda request: "Checking. " + WEATHER_CALL
    data = events((await client.post(URL, json={"input": "Weather?", "tools": [WEATHER_TOOL], "stream": True})).text)
    kinds = [e["type"] for e in data]
    tail = kinds[kinds.index("response.output_text.done"):]
    deltas = tail.count("response.function_call_arguments.delta")  # as the model wrote them (formats/tools/scanning.py)
    assert deltas > 1 and tail == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    joined = "".join(e["delta"] for e in data if e["type"] == "response.function_call_arguments.delta")
    assert joined == data[-3]["arguments"] == data[-2]["item"]["arguments"]
    added = data[kinds.index("response.output_item.added", 3)]
    assert added["output_index"] == 1 and added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    done = data[-2]["item"]
    assert json.loads(done["arguments"]) == {"city": "Paris"} and done["name"] == "get_weather"
    assert [i["type"] for i in data[-1]["response"]["output"]] == ["message", "function_call"]


async def test_stream_that_hits_max_output_tokens_ends_incomplete(client: httpx.AsyncClient) -> None:
    data = events((await client.post(URL, json={"input": "Hi", "stream": True, "max_output_tokens": 2})).text)
    assert data[-1]["type"] == "response.incomplete"
    assert data[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# -- errors: the API's shape, nothing stored, nothing generated ----------------------------------------
@pytest.mark.parametrize("fields, param", [
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input[0].arguments"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "teleport"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters.type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"properties": []}}]}, "tools[0].parameters.properties"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"temperature": 3}, "temperature"),
    ({"background": True}, "background"),
])
async def test_bad_input_is_400_and_stores_nothing(client: httpx.AsyncClient, engine: ScriptedEngine,
                                                   service: EngineService, fields: dict, param: str) -> None:
    response = await client.post(URL, json={"input": "Hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert engine.requests == [] and stored_files(service) == []


async def test_unknown_previous_response_is_404(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    for rid in ("resp_" + "0" * 32, "../../etc/passwd", "x"):
        response = await client.post(URL, json={"input": "Hi", "previous_response_id": rid})
        assert response.status_code == 404 and response.json()["error"]["param"] == "previous_response_id"
    assert (await client.get(f"{URL}/resp_missing")).status_code == 404
    assert engine.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_too_long_is_a_context_length_error(tmp_path: Path, stream: bool) -> None:
    engine = ScriptedEngine(loaded=scripted_loaded(context=64))
    service = make_service(tmp_path, engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(service)), base_url="http://t") as http:
        response = await http.post(URL, json={"input": "x" * 200, "stream": stream})
    if stream:  # what Codex reads as a full context window (a 400 it would only print)
        assert response.status_code == 200
        data = events(response.text)
        assert [e["type"] for e in data] == ["response.created", "response.in_progress", "response.failed"]
        assert data[-1]["response"]["status"] == "failed"
        assert data[-1]["response"]["error"]["code"] == "context_length_exceeded"
    else:
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert engine.requests == [] and stored_files(service) == []


@pytest.mark.parametrize("stream", [False, True])
async def test_pool_exhaustion_is_429(tmp_path: Path, stream: bool) -> None:
    service = make_service(tmp_path, PoolExhaustedEngine())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(service)), base_url="http://t") as http:
        response = await http.post(URL, json={"input": "Hi", "stream": stream})
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert response.json()["error"]["type"] == "rate_limit_error" and stored_files(service) == []


async def test_engine_failure_mid_stream_is_response_failed(tmp_path: Path) -> None:
    service = make_service(tmp_path, ScriptedEngine(fail_with="Metal out of memory"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(service)), base_url="http://t") as http:
        plain = await http.post(URL, json={"input": "Hi"})
        streamed = await http.post(URL, json={"input": "Hi", "stream": True})
    assert plain.status_code == 500 and "Metal out of memory" in plain.json()["error"]["message"]
    data = events(streamed.text)
    assert data[-1]["type"] == "response.failed"
    assert data[-1]["response"]["error"] == {"code": "server_error",
                                             "message": "generation failed: Metal out of memory"}
    assert stored_files(service) == []


# -- the official SDK on a real socket -----------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, ScriptedEngine]]:
    engine = ScriptedEngine(lambda request: "Hello there.")
    with LiveServer(build_app(make_service(tmp_path_factory.mktemp("live"), engine))) as server:
        yield server, engine


@pytest.fixture
def sdk(live: tuple[LiveServer, ScriptedEngine]) -> openai.OpenAI:
    live[1].script = lambda request: "Hello there."
    return openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="x", max_retries=0)


def test_sdk_create_stream_and_tool_round_trip(sdk: openai.OpenAI, live: tuple[LiveServer, ScriptedEngine]) -> None:
    first = sdk.responses.create(model="gpt-5", input="Hi")
    assert first.output_text == "Hello there." and first.usage is not None
    with sdk.responses.stream(model="gpt-5", input="More", previous_response_id=first.id) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there."
    assert final.usage.input_tokens_details.cached_tokens > 0
    decode = live[1].loaded.tokenizer.decode
    live[1].script = lambda request: "It is 18C." if "18C" in decode(list(request.prompt_tokens)) else WEATHER_CALL
    asked = sdk.responses.create(model="gpt-5", input="Weather in Paris?", tools=[WEATHER_TOOL])
    (call,) = [item for item in asked.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    answered = sdk.responses.create(model="gpt-5", previous_response_id=asked.id, tools=[WEATHER_TOOL],
                                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}])
    assert answered.output_text == "It is 18C."
    assert sdk.responses.retrieve(answered.id).output_text == "It is 18C."
    assert [i.type for i in sdk.responses.input_items.list(answered.id).data] == ["function_call_output"]
    assert sdk.responses.delete(answered.id) is None
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(answered.id)



async def test_text_after_a_tool_call_is_its_own_item_even_when_it_repeats(client: httpx.AsyncClient,
                                                                         engine: ScriptedEngine) -> None:
    engine.script = lambda request: "Checking. " + WEATHER_CALL + "Checking. "
    data = events((await client.post(URL, json={"input": "Weather?", "tools": [WEATHER_TOOL], "stream": True})).text)
    done = [e for e in data if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["type"]) for e in done] == [(0, "message"), (1, "function_call"),
                                                                       (2, "message")]
    assert [i["type"] for i in data[-1]["response"]["output"]] == ["message", "function_call", "message"]
