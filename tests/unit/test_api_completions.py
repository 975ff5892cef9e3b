"""POST /v1/completions against a ScriptedEngine: a raw prompt continued as it is (no template, no turn ends),
the response and stream shapes, echo, token-id prompts, the fields refused by name, and the official SDK."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI

from engine.domain.requests import GenerationRequest
from tests.support.byte_tokenizer import BOS, VOCAB_SIZE
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine
from tests.unit.test_api_openai import frames

URL = "/v1/completions"
TRANSCRIPT = "User: hi\n\nAssistant: Hello.\n\nUser: more"


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(lambda request: " world, and on.")


def last(engine: ScriptedEngine) -> GenerationRequest:
    return engine.requests[-1]


async def test_a_raw_prompt_is_continued_as_it_is(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    response = await client.post(URL, json={"model": "base", "prompt": "Hello", "max_tokens": 40})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "base"
    assert body["choices"] == [{"text": " world, and on.", "index": 0, "logprobs": None, "finish_reason": "stop"}]
    usage = body["usage"]
    assert usage["prompt_tokens"] == len("Hello") + 1 and usage["completion_tokens"] == len(" world, and on.")
    request = last(engine)
    # The tokenizer's own special tokens (its BOS), then the text's tokens: no chat template around it.
    assert request.prompt_tokens == (BOS, *b"Hello")
    assert request.max_tokens == 40 and request.turn_end_strings == () and request.plain_text
    assert body["agent_id"] == "completions" and response.headers["x-semantic-agent-id"] == "completions"


async def test_a_transcript_in_the_prompt_is_not_cut_at_the_next_speaker(client: httpx.AsyncClient,
                                                                         engine: ScriptedEngine) -> None:
    # A chat turn of a model with no template ends at "\n\nUser:"; a raw completion runs on through it.
    engine.script = lambda request: " Sure.\n\nUser: and then"
    response = await client.post(URL, json={"prompt": TRANSCRIPT})
    assert response.json()["choices"][0]["text"] == " Sure.\n\nUser: and then"


async def test_stop_strings_and_length(client: httpx.AsyncClient) -> None:
    stopped = (await client.post(URL, json={"prompt": "Hi", "stop": ","})).json()["choices"][0]
    assert stopped["text"] == " world" and stopped["finish_reason"] == "stop"
    capped = (await client.post(URL, json={"prompt": "Hi", "max_tokens": 3})).json()["choices"][0]
    assert capped["text"] == " wo" and capped["finish_reason"] == "length"


async def test_token_ids_and_echo(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    ids = list(b"Count: 1 2")
    body = (await client.post(URL, json={"prompt": ids, "echo": True})).json()
    assert last(engine).prompt_tokens == tuple(ids)  # token ids go in as they are, nothing added
    assert body["choices"][0]["text"] == "Count: 1 2 world, and on."
    texts = (await client.post(URL, json={"prompt": ["Say"], "echo": True})).json()
    assert texts["choices"][0]["text"] == "Say world, and on."
    await client.post(URL, json={"prompt": [ids]})
    assert last(engine).prompt_tokens == tuple(ids)


async def test_session_id_names_the_agent_and_its_cache_is_reused(client: httpx.AsyncClient) -> None:
    first = (await client.post(URL, json={"prompt": "Once upon", "session_id": "story"})).json()
    assert first["agent_id"] == "oa-story"
    again = (await client.post(URL, json={"prompt": "Once upon" + first["choices"][0]["text"] + " Then",
                                          "session_id": "story"})).json()
    # The first prompt and its completion, as the engine cached them.
    cached = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


async def test_stream_frames(client: httpx.AsyncClient) -> None:
    response = await client.post(URL, json={"prompt": "Hi", "stream": True, "echo": True,
                                            "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    data = frames(response.text)
    assert data[-1] == "[DONE]"
    chunks = [d for d in data[:-1] if d != ":"]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["text"] == "Hi"  # echo first
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "Hi world, and on."
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(" world, and on.")


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [1, VOCAB_SIZE]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": 1}, "logprobs"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "temperature": 5}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "session_id": "bad id"}, "session_id"),
    ({"prompt": "x", "priority": "urgent"}, "priority"),
    ({}, "prompt"),
])
async def test_bad_fields_are_400_naming_the_field(client: httpx.AsyncClient, fields: dict[str, Any],
                                                   param: str) -> None:
    response = await client.post(URL, json=fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


async def test_too_long_is_a_400_before_anything_runs(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    response = await client.post(URL, json={"prompt": "x" * 5000})
    assert response.status_code == 400 and "prompt is too long" in response.json()["error"]["message"]
    assert not engine.requests


async def test_metrics_count_the_protocol(client: httpx.AsyncClient, app: FastAPI) -> None:
    await client.post(URL, json={"prompt": "Hi"})
    await client.post(URL, json={"prompt": "Hi", "stream": True})
    await client.post(URL, json={"prompt": [-5]})
    registry = app.state.metrics.registry
    assert registry.get_sample_value("semantic_requests_total", {"protocol": "completions", "outcome": "stop"}) == 2
    assert registry.get_sample_value("semantic_requests_total",
                                     {"protocol": "completions", "outcome": "rejected"}) == 1


# -- the official SDK over a real socket -----------------------------------------------------------
@pytest.fixture(scope="module")
def sdk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    service = make_service(Path(tmp_path_factory.mktemp("completions")), ScriptedEngine(lambda r: " and so on."))
    with LiveServer(build_app(service)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def test_sdk_completion_stream_and_errors(sdk: openai.OpenAI) -> None:
    completion = sdk.completions.create(model="base", prompt="One, two", max_tokens=20)
    assert completion.object == "text_completion" and completion.choices[0].text == " and so on."
    assert completion.choices[0].finish_reason == "stop" and completion.usage is not None
    chunks = list(sdk.completions.create(model="base", prompt="One, two", stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " and so on."
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(" and so on.")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(model="base", prompt="x", logprobs=2)
    assert refused.value.param == "logprobs"
