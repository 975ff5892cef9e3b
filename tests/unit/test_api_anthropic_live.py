"""The Anthropic API over a real socket: the official SDK, client disconnects;
and the stream's keep-alive and cancellation on a hand-fed turn."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import httpx2
import pytest

from engine.api.anthropic_stream import MessageHead, MessageStream
from engine.api.async_turn import AsyncTurn
from engine.api.turns import OutputAssembler
from engine.domain.requests import (
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PrefillEvent,
    TokenEvent,
    Usage,
)
from tests.support.byte_tokenizer import ByteTokenizer
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded

from .anthropic_helpers import TOOL_OUTPUT, WEATHER_TOOL, SlowAdmissionEngine, body, sse_events

CONTEXT = 2048


def weather_or_greeting(request: GenerationRequest) -> str:
    prompt = ByteTokenizer().decode(list(request.prompt_tokens))
    return TOOL_OUTPUT if "weather" in prompt.rsplit("<user>", 1)[-1] else "Hello from the scripted model."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = ScriptedEngine(script=weather_or_greeting, loaded=scripted_loaded(context=CONTEXT), prefill_delay_s=0.15)
    app = build_app(make_service(tmp_path_factory.mktemp("sdk"), engine, ping_interval_s=0.05))
    with LiveServer(app) as live:
        yield live


@pytest.fixture
def sdk(server):
    with anthropic.Anthropic(base_url=server.url, api_key="sk-local", max_retries=0) as client:
        yield client


# -- the official SDK ------------------------------------------------------------------------------------
def test_sdk_create(sdk):
    message = sdk.messages.create(model="claude-opus-5-5", max_tokens=100,
                                  messages=[{"role": "user", "content": "Hello"}])
    assert message.content[0].type == "text" and message.content[0].text == "Hello from the scripted model."
    assert message.stop_reason == "end_turn" and message.model == "claude-opus-5-5"
    assert message.usage.output_tokens == len("Hello from the scripted model.")


def test_sdk_stream_with_tool_call(sdk):
    texts = []
    with sdk.messages.stream(model="claude-opus-5-5", max_tokens=100, tools=[WEATHER_TOOL],
                             messages=[{"role": "user", "content": "What is the weather in Paris?"}]) as stream:
        for text in stream.text_stream:
            texts.append(text)
        final = stream.get_final_message()
    assert "".join(texts) == "Let me check."
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert (final.content[1].name, final.content[1].input) == ("get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use"
    usage = final.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == sdk.messages.count_tokens(
        model="claude-opus-5-5", tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "What is the weather in Paris?"}]).input_tokens


def test_sdk_too_long_prompt_is_a_bad_request(sdk):
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.create(model="claude-opus-5-5", max_tokens=100,
                            messages=[{"role": "user", "content": "x" * (CONTEXT + 10)}])
    assert caught.value.status_code == 400
    assert f"tokens > {CONTEXT} maximum" in caught.value.message and "prompt is too long: " in caught.value.message


async def test_async_sdk_reads_a_stream_that_pings_before_admission(tmp_path):
    """A turn queued longer than a ping interval starts its stream with pings, then message_start."""
    engine = SlowAdmissionEngine(0.3, script=lambda r: "queued, then answered")
    app = build_app(make_service(tmp_path, engine, ping_interval_s=0.05))
    # The SDK runs on httpx2, which has its own ASGI transport (the sync client has none: see the live server).
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://testserver")
    async with anthropic.AsyncAnthropic(base_url="http://testserver", api_key="k", http_client=http) as sdk:
        raw = await sdk.messages.with_raw_response.create(model="m", max_tokens=50, stream=True,
                                                          messages=[{"role": "user", "content": "hi"}])
        kinds = [name for name, _ in sse_events((await raw.http_response.aread()).decode())]
        assert kinds[:2] == ["ping", "ping"] and "message_start" in kinds
        async with sdk.messages.stream(model="m", max_tokens=50, messages=[{"role": "user", "content": "hi"}]) as stream:
            final = await stream.get_final_message()
    assert final.content[0].text == "queued, then answered" and final.stop_reason == "end_turn"


# -- client disconnects ------------------------------------------------------------------------------------
@pytest.fixture
def slow_server(tmp_path):
    engine = ScriptedEngine(script=lambda r: "word " * 400, token_delay_s=0.005)
    with LiveServer(build_app(make_service(tmp_path, engine, ping_interval_s=0.05))) as live:
        yield live, engine


def wait_for_cancel(engine: ScriptedEngine, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.cancelled and engine.requests[0].request_id in engine.cancelled:
            return True
        time.sleep(0.02)
    return False


def test_closing_a_stream_cancels_the_generation(slow_server):
    live, engine = slow_server
    with httpx.Client(base_url=live.url) as http, http.stream("POST", "/v1/messages", json=body(stream=True)) as response:
        for line in response.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    assert wait_for_cancel(engine)


def test_abandoning_a_non_streaming_request_cancels_the_generation(slow_server):
    live, engine = slow_server
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=live.url, timeout=0.3) as http:
        http.post("/v1/messages", json=body())
    assert wait_for_cancel(engine)


# -- a hand-fed turn -----------------------------------------------------------------------------------------
class HandFedEngine:
    """Takes one submission and lets the test push its events."""

    def __init__(self) -> None:
        self.sink = None
        self.cancelled: list[str] = []

    def submit(self, request, sink) -> str:
        self.sink = sink
        return request.request_id

    def cancel(self, request_id, reason=FinishReason.CANCELLED) -> None:
        self.cancelled.append(request_id)


def hand_fed_stream(ping_s: float):
    engine, recorded = HandFedEngine(), []
    request = GenerationRequest("agent", (1, 2, 3), 10)
    turn = AsyncTurn(engine, request)
    stream = MessageStream(turn, OutputAssembler(None), MessageHead("msg_1", "m", 3), ping_s,
                           lambda finish, outcome: recorded.append((finish, outcome)))
    return engine, request, stream, recorded


async def test_pings_count_from_the_last_frame_not_the_last_event():
    """Prefill progress arrives often but sends nothing: pings must still go out."""
    engine, request, stream, recorded = hand_fed_stream(ping_s=0.1)

    async def feed():
        for done in range(20):
            await asyncio.sleep(0.02)
            engine.sink(PrefillEvent(request.request_id, done, 20, 1))
        engine.sink(FinishEvent(request.request_id, FinishReason.STOP, Usage(3, 1, 2, 0)))

    feeder = asyncio.create_task(feed())
    frames = b"".join([frame async for frame in stream.frames()])
    await feeder
    kinds = [name for name, _ in sse_events(frames.decode())]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("ping") >= 2
    assert recorded[0][1] is None and recorded[0][0].reason is FinishReason.STOP


async def test_closing_the_frames_cancels_and_records_once():
    engine, request, stream, recorded = hand_fed_stream(ping_s=1.0)
    engine.sink(PrefillEvent(request.request_id, 0, 3, 0))
    engine.sink(TokenEvent(request.request_id, 72, "H"))
    frames = stream.frames()
    first = await frames.__anext__()
    assert first.startswith(b"event: message_start\n")
    await frames.aclose()
    stream.close()
    assert engine.cancelled == [request.request_id] and recorded == [(None, "cancelled")]
