"""POST /v1/chat/completions against a ScriptedEngine: translation, responses,
streaming frames, errors, session reuse, disconnects, and the official SDK."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI

from engine.api.service import EngineService
from tests.support.engine_faults import POOL_MESSAGE, FailsMidStreamEngine, PoolExhaustedEngine
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded

URL = "/v1/chat/completions"
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def ask(text: str = "Hi", **fields: Any) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": text}], **fields}


def frames(body: str) -> list[Any]:
    """Data payloads of an SSE body (JSON, or the string "[DONE]"); comments become ":"."""
    out: list[Any] = []
    for block in filter(None, body.split("\n\n")):
        if block.startswith(":"):
            out.append(":")
        else:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def prompt_text(engine: ScriptedEngine, index: int = -1) -> str:
    return engine.loaded.tokenizer.decode(list(engine.requests[index].prompt_tokens))


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(lambda request: "Hello there.")




# -- non-streaming ------------------------------------------------------------------------------
async def test_completion_shape(client: httpx.AsyncClient) -> None:
    response = await client.post(URL, json=ask("Hi", session_id="s1"))
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "gpt-4o" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello there."},
                                "logprobs": None, "finish_reason": "stop"}]
    usage = body["usage"]
    assert usage["completion_tokens"] == len("Hello there.")
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["agent_id"] == "oa-s1" and response.headers["x-semantic-agent-id"] == "oa-s1"


async def test_messages_render_into_the_prompt(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "input_audio"}]},
        {"role": "assistant", "content": "Nice."},
        {"role": "user", "content": "Thanks"},
    ]
    response = await client.post(URL, json={"model": "x", "messages": messages, "user": "ignored", "logprobs": False})
    assert response.status_code == 200
    assert prompt_text(engine) == "System: Be brief.\n\nUser: Look:\n[input_audio]\n\nAssistant: Nice.\n\nUser: Thanks\n\nAssistant:"


async def test_tool_round_trip_renders_calls_and_results(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    response = await client.post(URL, json={"messages": messages, "tools": [WEATHER_TOOL]})
    assert response.status_code == 200
    prompt = prompt_text(engine)
    assert '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>' in prompt
    assert prompt.endswith("User: <tool_response>\n18C\n</tool_response>\n\nAssistant:")
    assert '"name": "get_weather"' in prompt.split("User: Weather?")[0]  # the tool listing in the system turn


async def test_bad_tool_call_arguments_are_400(client: httpx.AsyncClient) -> None:
    messages = [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]
    response = await client.post(URL, json={"messages": messages})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.tool_calls.0"


async def test_sampling_defaults_to_the_models(client: httpx.AsyncClient, engine: ScriptedEngine, service: EngineService) -> None:
    await client.post(URL, json=ask())
    request = engine.requests[-1]
    # The scripted model has no generation_config.json: the documented fallback.
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.seed) == (0.7, 0.95, None)
    assert request.max_tokens == service.settings.default_max_tokens
    assert request.stop_strings == ()


async def test_sampling_fields_are_passed_on(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    await client.post(URL, json=ask(temperature=0.7, top_p=0.9, seed=42, max_tokens=50, stop="END"))
    request = engine.requests[-1]
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.seed) == (0.7, 0.9, 42)
    assert request.max_tokens == 50 and request.stop_strings == ("END",)
    await client.post(URL, json=ask(max_tokens=50, max_completion_tokens=7, stop=["A", "", "B"], seed=-1))
    assert engine.requests[-1].max_tokens == 7 and engine.requests[-1].stop_strings == ("A", "B")
    assert engine.requests[-1].sampling.seed == 2**64 - 1


async def test_stop_and_length_finish_reasons(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.script = lambda request: "Hello STOP world"
    body = (await client.post(URL, json=ask(stop=["STOP"]))).json()
    assert body["choices"][0]["message"]["content"] == "Hello "
    assert body["choices"][0]["finish_reason"] == "stop"
    body = (await client.post(URL, json=ask(max_tokens=3))).json()
    assert body["choices"][0]["message"]["content"] == "Hel"
    assert body["choices"][0]["finish_reason"] == "length"


async def test_tool_call_in_the_output(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.script = lambda request: WEATHER_CALL
    body = (await client.post(URL, json=ask("Weather?", tools=[WEATHER_TOOL]))).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


async def test_tool_choice_none_returns_calls_as_text(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.script = lambda request: WEATHER_CALL
    body = (await client.post(URL, json=ask(tools=[WEATHER_TOOL], tool_choice="none"))).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": WEATHER_CALL}
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("choice, status", [
    ("required", 200), ({"type": "function", "function": {"name": "get_weather"}}, 200),
    ({"type": "function", "function": {"name": "other"}}, 400), ("sometimes", 400),
])
async def test_tool_choice_values(client: httpx.AsyncClient, choice: Any, status: int) -> None:
    response = await client.post(URL, json=ask(tools=[WEATHER_TOOL], tool_choice=choice))
    assert response.status_code == status
    if status == 400:
        assert response.json()["error"]["param"].startswith("tool_choice")


async def test_tool_choice_required_needs_tools(client: httpx.AsyncClient) -> None:
    response = await client.post(URL, json=ask(tool_choice="required"))
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


# -- sessions and reuse ---------------------------------------------------------------------------
async def test_second_turn_of_a_session_reports_cached_tokens(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    first = (await client.post(URL, json=ask("Hi", session_id="chat-1"))).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
               {"role": "user", "content": "More"}]
    second = (await client.post(URL, json={"messages": history}, headers={"X-Session-Id": "chat-1"})).json()
    # The whole first prompt is reused: the scripted cache holds it plus the reply.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(engine.requests[0].prompt_tokens)
    assert {r.agent_id for r in engine.requests} == {"oa-chat-1"}


async def test_without_session_the_agent_is_the_prefix_hash(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    await client.post(URL, json=ask("one"))
    await client.post(URL, json=ask("two"))
    assert engine.requests[0].agent_id == engine.requests[1].agent_id
    assert engine.requests[0].agent_id.startswith("openai-")


async def test_invalid_session_id_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(URL, json=ask(session_id="../etc"))
    assert response.status_code == 400 and response.json()["error"]["param"] == "session_id"


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param", [
    ({"temperature": 5}, "temperature"), ({"n": 2}, "n"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
])
async def test_invalid_fields_are_400_in_openai_shape(client: httpx.AsyncClient, fields: dict, param: str) -> None:
    response = await client.post(URL, json={**ask(), **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(URL, content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]


async def test_prompt_too_long_is_400(tmp_path: Path) -> None:
    engine = ScriptedEngine(loaded=scripted_loaded(context=64))
    app = build_app(make_service(tmp_path, engine))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        response = await http.post(URL, json=ask("x" * 200, stream=True))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "prompt is too long: 219 tokens > 64 maximum"
    assert engine.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_pool_exhaustion_before_output_is_429(tmp_path: Path, stream: bool) -> None:
    app = build_app(make_service(tmp_path, PoolExhaustedEngine()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        response = await http.post(URL, json=ask(stream=stream))
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert response.json() == {"error": {"message": POOL_MESSAGE, "type": "rate_limit_error", "param": None, "code": None}}


async def test_engine_failure_is_500(tmp_path: Path) -> None:
    app = build_app(make_service(tmp_path, ScriptedEngine(fail_with="Metal out of memory")))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        response = await http.post(URL, json=ask())
        streamed = await http.post(URL, json=ask(stream=True))
    error = {"message": "generation failed: Metal out of memory", "type": "server_error", "param": None, "code": None}
    assert response.status_code == 500 and response.json()["error"] == error
    # The prefill had begun, so the stream was committed: the failure comes as a frame.
    assert streamed.status_code == 200 and frames(streamed.text)[-2:] == [{"error": error}, "[DONE]"]


async def test_failure_after_streaming_started_is_an_error_frame(tmp_path: Path) -> None:
    app = build_app(make_service(tmp_path, FailsMidStreamEngine()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        response = await http.post(URL, json=ask(stream=True))
    assert response.status_code == 200
    data = frames(response.text)
    assert "".join(f["choices"][0]["delta"].get("content", "") for f in data[:-2]) == "partial"
    assert data[-2] == {"error": {"message": "generation failed: engine step failed: boom", "type": "server_error",
                                  "param": None, "code": None}}
    assert data[-1] == "[DONE]"


# -- streaming -------------------------------------------------------------------------------------
async def test_stream_frames(client: httpx.AsyncClient) -> None:
    response = await client.post(URL, json=ask(stream=True, stream_options={"include_usage": True}))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    data = frames(response.text)
    chunks, usage_chunk, done = data[:-2], data[-2], data[-1]
    assert done == "[DONE]"
    assert {(c["id"], c["created"], c["object"], c["model"]) for c in data[:-1]} == {
        (chunks[0]["id"], chunks[0]["created"], "chat.completion.chunk", "gpt-4o")}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello there."
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len("Hello there.")


async def test_stream_without_include_usage_has_no_usage_chunk(client: httpx.AsyncClient) -> None:
    data = frames((await client.post(URL, json=ask(stream=True))).text)
    assert data[-1] == "[DONE]" and data[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(f["choices"] for f in data[:-1])


async def test_stream_tool_call_deltas(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.script = lambda request: "Checking. " + WEATHER_CALL
    data = frames((await client.post(URL, json=ask(stream=True, tools=[WEATHER_TOOL]))).text)
    deltas = [f["choices"][0]["delta"] for f in data[:-1]]
    assert "".join(d.get("content", "") for d in deltas) == "Checking. "
    header, *arguments = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert header["index"] == 0 and header["id"].startswith("call_") and header["type"] == "function"
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    # The arguments as the model wrote them, a token's text at a time (formats/tools/scanning.py).
    assert len(arguments) > 1 and all(a["index"] == 0 and set(a) == {"index", "function"} for a in arguments)
    assert "".join(a["function"]["arguments"] for a in arguments) == '{"city": "Paris"}'
    assert data[-2]["choices"][0]["finish_reason"] == "tool_calls"


async def test_keep_alive_comments_during_a_long_prefill(tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda request: "ok", prefill_delay_s=0.3)
    app = build_app(make_service(tmp_path, engine, ping_interval_s=0.05))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        response = await http.post(URL, json=ask(stream=True))
    assert ": keep-alive\n\n" in response.text
    data = frames(response.text)
    assert data[0]["choices"][0]["delta"]["role"] == "assistant"
    first_content = next(i for i, f in enumerate(data) if f != ":" and f["choices"][0]["delta"].get("content"))
    assert data[1:first_content].count(":") >= 2


async def test_metrics_count_each_request_once(client: httpx.AsyncClient, app: FastAPI) -> None:
    await client.post(URL, json=ask())
    await client.post(URL, json=ask(stream=True))
    await client.post(URL, json=ask(session_id="bad id"))
    registry = app.state.metrics.registry
    assert registry.get_sample_value("semantic_requests_total", {"protocol": "openai", "outcome": "stop"}) == 2
    assert registry.get_sample_value("semantic_requests_total", {"protocol": "openai", "outcome": "rejected"}) == 1


# -- a real socket: client disconnects and the official SDK ----------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, ScriptedEngine]]:
    engine = ScriptedEngine(lambda request: "Hello there.")
    service = make_service(tmp_path_factory.mktemp("live"), engine)
    with LiveServer(build_app(service)) as server:
        yield server, engine


@pytest.fixture
def sdk(live: tuple[LiveServer, ScriptedEngine]) -> openai.OpenAI:
    live[1].script = lambda request: "Hello there."
    live[1].token_delay_s = 0.0
    return openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="x", max_retries=0)


def _wait_cancelled(engine: ScriptedEngine, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.requests[-1].request_id not in engine.cancelled:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.02)


def test_stream_disconnect_cancels_the_generation(live: tuple[LiveServer, ScriptedEngine]) -> None:
    server, engine = live
    engine.script, engine.token_delay_s = (lambda request: "z" * 500), 0.01
    with httpx.Client(base_url=server.url) as http:
        with http.stream("POST", URL, json=ask(stream=True)) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
    _wait_cancelled(engine)


def test_non_streaming_disconnect_cancels_the_generation(live: tuple[LiveServer, ScriptedEngine]) -> None:
    server, engine = live
    engine.script, engine.token_delay_s = (lambda request: "z" * 500), 0.01
    with httpx.Client(base_url=server.url, timeout=0.2) as http, pytest.raises(httpx.ReadTimeout):
        http.post(URL, json=ask())
    _wait_cancelled(engine)


def test_sdk_completion_and_cached_tokens(sdk: openai.OpenAI) -> None:
    first = sdk.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}],
                                        extra_body={"session_id": "sdk-1"})
    assert first.choices[0].message.content == "Hello there." and first.choices[0].finish_reason == "stop"
    second = sdk.chat.completions.create(
        model="gpt-4o", extra_headers={"X-Session-Id": "sdk-1"},
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
                  {"role": "user", "content": "Again"}])
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens  # type: ignore[union-attr]


def test_sdk_stream_with_usage_and_tools(sdk: openai.OpenAI, live: tuple[LiveServer, ScriptedEngine]) -> None:
    live[1].script = lambda request: "Sure. " + WEATHER_CALL
    stream = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather?"}],
                                         tools=[WEATHER_TOOL], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert text == "Sure. " and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"city": "Paris"}  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_sdk_errors(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as invalid:
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], temperature=9)
    assert invalid.value.param == "temperature"
    with pytest.raises(openai.BadRequestError, match=r"prompt is too long: \d+ tokens > 4096 maximum"):
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 5000}])


def test_sdk_raises_on_a_mid_stream_error(tmp_path: Path) -> None:
    with LiveServer(build_app(make_service(tmp_path, FailsMidStreamEngine()))) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], stream=True)
        with pytest.raises(openai.APIError, match="generation failed: engine step failed: boom"):
            list(stream)


async def test_a_model_without_a_chat_template_ends_replies_at_the_next_speaker(
    client: httpx.AsyncClient, engine: ScriptedEngine,
) -> None:
    # The scripted tokenizer has no chat template: prompts are plain User:/Assistant: paragraphs.
    await client.post(URL, json=ask())
    assert engine.requests[-1].turn_end_strings == ("\n\nUser:", "\n\nAssistant:", "\n\nSystem:")
    assert engine.requests[-1].stop_strings == ()
