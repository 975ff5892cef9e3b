"""POST /v1/messages and friends over ASGI, with scripted model output."""

from __future__ import annotations

import json

import pytest

from engine.api.anthropic_schemas import CountTokensRequest
from engine.api.anthropic_translate import conversation_of
from engine.api.turns import render_tokens
from tests.support.router_app import build_app, make_service
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded

from .anthropic_helpers import (
    TOOL_OUTPUT,
    WEATHER_TOOL,
    RateLimitedEngine,
    assert_well_formed,
    body,
    client,
    names,
    sse_events,
    streamed_content,
)


@pytest.fixture
def make(tmp_path):
    def build(engine: ScriptedEngine | None = None, **settings):
        engine = engine or ScriptedEngine()
        return build_app(make_service(tmp_path, engine, **settings)), engine

    return build


async def post(app, payload, path="/v1/messages", **kwargs):
    async with client(app) as http:
        return await http.post(path, json=payload, **kwargs)


def requests_counted(app, outcome: str) -> float:
    return app.state.metrics.registry.get_sample_value(
        "semantic_requests_total", {"protocol": "anthropic", "outcome": outcome}) or 0.0


# -- the model a reply names ------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_reply_names_the_1m_variant_when_the_client_asked_for_the_1m_beta(make, stream: bool):
    """Claude Code restores a continued session's model from its replies; a plain name would switch
    it to the 200K variant, whose system prompt differs (reply_model.py)."""
    app, _ = make(ScriptedEngine(script=lambda r: "Hi!"))
    betas = {"anthropic-beta": "claude-code-20250219,context-1m-2025-08-07,effort-2025-11-24"}
    asked = await post(app, body(stream=stream), headers=betas)
    plain = await post(app, body(stream=stream))
    already = await post(app, body(stream=stream, model="claude-opus-5-5[1m]"), headers=betas)

    def named(response) -> str:
        return sse_events(response.text)[0][1]["message"]["model"] if stream else response.json()["model"]

    assert (named(asked), named(plain), named(already)) == (
        "claude-opus-5-5[1m]", "claude-opus-5-5", "claude-opus-5-5[1m]")


# -- plain text ------------------------------------------------------------------------------------
async def test_non_streaming_message(make):
    app, engine = make(ScriptedEngine(script=lambda r: "Hi there!"))
    response = await post(app, body())
    assert response.status_code == 200
    message = response.json()
    prompt = len(engine.requests[0].prompt_tokens)
    assert message["id"].startswith("msg_") and message.pop("id")
    assert message == {
        "type": "message", "role": "assistant", "model": "claude-opus-5-5",
        "content": [{"type": "text", "text": "Hi there!"}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                  "output_tokens": 9},
    }
    assert requests_counted(app, "stop") == 1


async def test_streamed_message_exact_sequence(make):
    app, engine = make(ScriptedEngine(script=lambda r: "Hi!"))
    response = await post(app, body(stream=True), params={"beta": "true"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
    events = sse_events(response.text)
    assert names(events) == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                             "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    prompt = len(engine.requests[0].prompt_tokens)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == "claude-opus-5-5"
    assert start["usage"] == {"input_tokens": prompt, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 0, "output_tokens": 0}
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[2][1] == {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "H"}}
    delta = [data for name, data in events if name == "message_delta"][0]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3
    assert streamed_content(events) == [{"type": "text", "text": "Hi!"}]
    assert events[-1][1] == {"type": "message_stop"}


@pytest.mark.parametrize("stream", [False, True])
async def test_usage_splits_the_prompt_into_reused_and_prefilled(make, stream):
    app, engine = make(ScriptedEngine(script=lambda r: "ok"))
    first = body("Tell me a story")
    await post(app, first)
    second = dict(first, stream=stream, messages=first["messages"] + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Another"}])
    response = await post(app, second)
    if stream:
        events = sse_events(response.text)
        usage, final = events[0][1]["message"]["usage"], [d for n, d in events if n == "message_delta"][0]["usage"]
        assert {k: v for k, v in final.items() if k != "output_tokens"} == {
            k: v for k, v in usage.items() if k != "output_tokens"}
    else:
        usage = response.json()["usage"]
    counted = (await post(app, second, path="/v1/messages/count_tokens?beta=true")).json()["input_tokens"]
    assert usage["cache_read_input_tokens"] > 0 and usage["input_tokens"] > 0
    assert usage["cache_creation_input_tokens"] == 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted == len(engine.requests[1].prompt_tokens)


async def test_count_tokens_uses_the_real_renderer(make):
    app, _ = make()
    payload = body([{"type": "text", "text": "count me"}], tools=[WEATHER_TOOL])
    payload.pop("max_tokens")
    response = await post(app, payload, path="/v1/messages/count_tokens")
    expected = await render_tokens(app.state.service, conversation_of(CountTokensRequest.model_validate(payload)))
    assert response.status_code == 200 and response.json() == {"input_tokens": len(expected)}


# -- tool calls -------------------------------------------------------------------------------------
async def test_streamed_tool_call(make):
    app, _ = make(ScriptedEngine(script=lambda r: TOOL_OUTPUT))
    response = await post(app, body("Weather in Paris?", tools=[WEATHER_TOOL], stream=True))
    events = sse_events(response.text)
    assert_well_formed(events)
    content = streamed_content(events)
    assert content[0] == {"type": "text", "text": "Let me check."}
    assert content[1]["type"] == "tool_use" and content[1]["id"].startswith("toolu_")
    assert (content[1]["name"], content[1]["input"]) == ("get_weather", {"city": "Paris"})
    tool_start = [d for n, d in events if n == "content_block_start"][1]["content_block"]
    assert tool_start["input"] == {}
    json_deltas = [d for n, d in events if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert len(json_deltas) > 1 and all(d["index"] == 1 for d in json_deltas)
    assert [d for n, d in events if n == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


async def test_non_streaming_tool_call(make):
    app, _ = make(ScriptedEngine(script=lambda r: TOOL_OUTPUT))
    message = (await post(app, body("Weather?", tools=[WEATHER_TOOL]))).json()
    assert message["stop_reason"] == "tool_use"
    assert message["content"][0] == {"type": "text", "text": "Let me check."}
    tool = message["content"][1]
    assert (tool["type"], tool["name"], tool["input"]) == ("tool_use", "get_weather", {"city": "Paris"})


async def content_and_stop(app, payload, stream: bool):
    """The reply's content (rebuilt from the deltas when streamed) and what carries its stop_reason."""
    response = await post(app, payload)
    if not stream:
        return response.json()["content"], response.json()
    events = sse_events(response.text)
    assert_well_formed(events)
    return streamed_content(events), [d for n, d in events if n == "message_delta"][0]["delta"]


@pytest.mark.parametrize("stream", [False, True])
async def test_malformed_tool_call_comes_back_as_text(make, stream):
    output = 'Trying.<tool_call>\n{"name": get_weather, "arguments": {"city": \n</tool_call>'
    app, _ = make(ScriptedEngine(script=lambda r: output))
    content, stop = await content_and_stop(app, body("Weather?", tools=[WEATHER_TOOL], stream=stream), stream)
    assert content == [{"type": "text", "text": output}] and stop["stop_reason"] == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_that_began_streaming_and_never_closed_ends_as_a_call_that_is_not_run(make, stream):
    """Its block began as the model wrote it; when the reply then hits its cap, the block holds what the
    arguments had and the reply says max_tokens, not tool_use: no client runs half a call."""
    output = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    app, _ = make(ScriptedEngine(script=lambda r: output))
    cap = output.index("ris")  # a character a token: the reply stops inside "Paris"
    content, stop = await content_and_stop(app, body("Weather?", tools=[WEATHER_TOOL], stream=stream, max_tokens=cap),
                                           stream)
    assert content[0] == {"type": "text", "text": "Checking."}
    assert (content[1]["type"], content[1]["input"]) == ("tool_use", {"city": "Pa"})
    assert stop["stop_reason"] == "max_tokens"


async def test_tool_markup_is_text_when_no_tools_were_offered(make):
    app, _ = make(ScriptedEngine(script=lambda r: TOOL_OUTPUT))
    message = (await post(app, body("Weather?"))).json()
    assert message["content"] == [{"type": "text", "text": TOOL_OUTPUT}] and message["stop_reason"] == "end_turn"


# -- endings --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, reason, sequence, text", [
    ({"stop_sequences": ["STOP"]}, "stop_sequence", "STOP", "one two "),
    ({"max_tokens": 4}, "max_tokens", None, "one "),
])
async def test_stop_reasons(make, stream, fields, reason, sequence, text):
    app, _ = make(ScriptedEngine(script=lambda r: "one two STOP three"))
    response = await post(app, body(stream=stream, **fields))
    if stream:
        events = sse_events(response.text)
        assert_well_formed(events)
        final = [d for n, d in events if n == "message_delta"][0]
        ending, content, output = final["delta"], streamed_content(events), final["usage"]["output_tokens"]
    else:
        message = response.json()
        ending, content, output = message, message["content"], message["usage"]["output_tokens"]
    assert (ending["stop_reason"], ending["stop_sequence"]) == (reason, sequence)
    assert content == [{"type": "text", "text": text}] and output == len(text)


async def test_empty_output_gives_no_blocks(make):
    app, _ = make(ScriptedEngine(script=lambda r: ""))
    events = sse_events((await post(app, body(stream=True))).text)
    assert names(events) == ["message_start", "message_delta", "message_stop"]
    assert (await post(app, body())).json()["content"] == []


# -- pings -------------------------------------------------------------------------------------------
async def test_pings_while_a_long_prompt_is_prefilled(make):
    app, _ = make(ScriptedEngine(script=lambda r: "done", prefill_delay_s=0.4), ping_interval_s=0.05)
    events = sse_events((await post(app, body(stream=True))).text)
    assert_well_formed(events)
    kinds = names(events, pings=True)
    assert kinds[0] == "message_start"
    assert kinds[1:kinds.index("content_block_start")].count("ping") >= 3


# -- errors -------------------------------------------------------------------------------------------
async def test_generation_error_without_streaming_is_a_500(make):
    app, _ = make(ScriptedEngine(fail_with="RuntimeError: metal exploded"))
    response = await post(app, body())
    assert response.status_code == 500
    assert response.json() == {"type": "error",
                               "error": {"type": "api_error", "message": "generation failed: RuntimeError: metal exploded"}}
    assert requests_counted(app, "error") == 1


async def test_generation_error_after_the_200_is_an_error_event(make):
    app, _ = make(ScriptedEngine(fail_with="RuntimeError: metal exploded", prefill_delay_s=0.1))
    response = await post(app, body(stream=True))
    assert response.status_code == 200
    events = sse_events(response.text)
    assert names(events) == ["message_start", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "generation failed: RuntimeError: metal exploded"}}


@pytest.mark.parametrize("stream", [False, True])
async def test_no_pool_room_at_admission_is_a_429(make, stream):
    app, _ = make(RateLimitedEngine())
    response = await post(app, body(stream=stream))
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert response.json()["error"] == {"type": "rate_limit_error", "message": "KV pool exhausted: 8/8 blocks"}


async def test_rate_limit_after_a_long_queue_is_an_error_event(make):
    app, _ = make(RateLimitedEngine(queue_s=0.3), ping_interval_s=0.05)
    response = await post(app, body(stream=True))
    assert response.status_code == 200
    events = sse_events(response.text)
    assert set(names(events, pings=True)[:-1]) == {"ping"}
    assert events[-1][1]["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_too_long_is_the_400_claude_code_compacts_on(make, stream):
    app, _ = make(ScriptedEngine(loaded=scripted_loaded(context=256)))
    response = await post(app, body("x" * 400, stream=stream))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ") and error["message"].endswith(" tokens > 256 maximum")
    assert requests_counted(app, "rejected") == 1


# -- request validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, field", [
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 42}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text.text"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": ["bare string"]}]}, "messages.0.content.0"),
    ({"messages": "hello"}, "messages"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stream": "maybe"}, "stream"),
    ({"tools": [{"description": "no name"}]}, "tools.0.name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"system": 7}, "system"),
    ({"model": None}, "model"),
])
async def test_bad_requests_are_400_naming_the_field(make, change, field):
    app, _ = make()
    payload = {k: v for k, v in (body() | change).items() if v is not None}
    response = await post(app, payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"], error


async def test_malformed_json_is_a_400(make):
    app, _ = make()
    async with client(app) as http:
        response = await http.post("/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["type"] == "error"


async def test_tolerated_fields_and_blocks(make):
    app, engine = make()
    payload = body(
        [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}, "citations": None},
         {"type": "brand_new_block_2030", "payload": {"x": 1}}],
        max_tokens=10**12, context_management={"edits": [{"type": "clear"}]}, output_config={"effort": "low"},
        thinking={"type": "enabled", "budget_tokens": 1024}, metadata={"user_id": "someone", "extra": 1},
        tools=[dict(WEATHER_TOOL, cache_control={"type": "ephemeral"}, defer_loading=True, strict=False),
               {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        model="some-model-that-does-not-exist")
    response = await post(app, payload, params={"beta": "true"}, headers={"anthropic-beta": "a,b,c"})
    assert response.status_code == 200 and response.json()["model"] == "some-model-that-does-not-exist"
    assert engine.requests[0].max_tokens < 10**12  # the engine clamped it to the context


async def test_claude_code_headers_name_the_agent(make):
    app, engine = make()
    headers = {"x-claude-code-session-id": "5f0c8a9e-aaaa-bbbb-cccc-0123456789ab", "x-api-key": "sk-anything",
               "anthropic-version": "2023-06-01", "user-agent": "claude-cli/2.1.328 (external, sdk-cli)"}
    response = await post(app, body(messages=[{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]),
                          headers=headers)
    assert response.status_code == 200
    assert engine.requests[0].agent_id.startswith("cc-5f0c8a9e-aaaa-bbbb-cccc-0123456789ab-")


async def test_bad_session_header_is_a_400(make):
    app, _ = make()
    response = await post(app, body(), headers={"x-claude-code-session-id": "not a valid id!"})
    assert response.status_code == 400 and "X-Claude-Code-Session-Id" in response.json()["error"]["message"]


# -- other endpoints ------------------------------------------------------------------------------------------
async def test_hello_probe(make):
    app, _ = make()
    async with client(app) as http:
        assert (await http.head("/api/hello")).status_code == 200
        assert (await http.get("/api/hello")).status_code == 200


def test_openapi_documents_the_messages_api(make):
    app, _ = make()
    document = app.openapi()
    operation = document["paths"]["/v1/messages"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/MessagesRequest")
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "/v1/messages/count_tokens" in document["paths"]
    json.dumps(document)
