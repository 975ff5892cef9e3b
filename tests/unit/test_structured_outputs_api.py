"""Structured outputs over HTTP, as the official SDKs send them, on a tiny random-weight llama (byte tokenizer).

Each SDK's own structured-output helper, unmodified: ``openai`` ``chat.completions.parse`` and
``responses.parse`` with a pydantic model, ``anthropic`` ``messages.parse`` with ``output_format``; streaming
too; and a schema llguidance cannot compile answered with a 400 in each protocol's error shape.
"""

from __future__ import annotations

import json
from typing import Iterator, Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.router_app import tiny_llama_api

pytestmark = pytest.mark.unit


class Pet(BaseModel):
    name: str = Field(max_length=8)
    legs: int = Field(ge=0, le=8)


class Choice(BaseModel):
    """What survives the Anthropic SDK's schema transform (it moves bounds such as max_length into descriptions,
    and a random model's unbounded string or integer may run to max_tokens): enums and booleans."""

    kind: Literal["cat", "dog"]
    friendly: bool


# Closed (no other properties), so a sampled reply of the random model is bounded: a name of at most 8 characters
# (32 bytes) and a one-digit number fit in 80 byte tokens whatever it samples.
PET_SCHEMA = {**Pet.model_json_schema(), "additionalProperties": False}
BROKEN = {"type": "object", "properties": {"a": {"type": "strin"}}}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from tiny_llama_api(tmp_path_factory.mktemp("so-api"))


@pytest.fixture(scope="module")
def gpt(url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="any", base_url=f"{url}/v1", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="any", base_url=url, max_retries=0, timeout=60)


ASK = [{"role": "user", "content": "Describe a pet."}]


def test_openai_parse_helper_gets_a_validated_object(gpt: openai.OpenAI) -> None:
    completion = gpt.chat.completions.parse(model="m", messages=ASK, response_format=Pet, max_tokens=80, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)


def test_openai_json_object_mode_and_streaming(gpt: openai.OpenAI) -> None:
    schema = PET_SCHEMA
    chunks = list(gpt.chat.completions.create(
        model="m", messages=ASK, max_tokens=80, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), schema)
    free_form = gpt.chat.completions.create(model="m", messages=ASK, max_tokens=200, temperature=0.7,
                                            response_format={"type": "json_object"})
    if free_form.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(free_form.choices[0].message.content or ""), dict)
    else:
        assert free_form.choices[0].finish_reason == "length"


def test_openai_truncated_json_is_length_and_the_parse_helper_says_so(gpt: openai.OpenAI) -> None:
    with pytest.raises(openai.LengthFinishReasonError):
        gpt.chat.completions.parse(model="m", messages=ASK, response_format=Pet, max_tokens=4)


def test_responses_parse_helper_and_the_echoed_format(gpt: openai.OpenAI) -> None:
    response = gpt.responses.parse(model="m", input="Describe a pet.", text_format=Pet, max_output_tokens=80,
                                   temperature=0)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Pet)
    assert response.text.format.type == "json_schema"


def test_anthropic_parse_helper_and_streaming(claude: anthropic.Anthropic) -> None:
    message = claude.messages.parse(model="claude-x", max_tokens=80, messages=ASK, output_format=Choice)
    assert message.stop_reason == "end_turn"
    assert isinstance(message.parsed_output, Choice)
    schema = PET_SCHEMA
    with claude.messages.stream(model="claude-x", max_tokens=80, messages=ASK,
                                output_config={"format": {"type": "json_schema", "schema": schema}}) as stream:
        final = stream.get_final_message()
    jsonschema.validate(json.loads(final.content[0].text), schema)
    cut = claude.messages.create(model="claude-x", max_tokens=4, messages=ASK,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert cut.stop_reason == "max_tokens"


def test_a_schema_that_cannot_compile_is_a_400_in_each_protocols_shape(gpt: openai.OpenAI,
                                                                         claude: anthropic.Anthropic,
                                                                         url: str) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        gpt.chat.completions.create(model="m", messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": BROKEN}})
    assert chat.value.body["param"] == "response_format" and "strin" in chat.value.body["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        gpt.responses.create(model="m", input="x", max_output_tokens=8,
                             text={"format": {"type": "json_schema", "name": "x", "schema": BROKEN}})
    assert responses.value.body["param"] == "text.format"
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(model="claude-x", max_tokens=8, messages=ASK,
                               output_config={"format": {"type": "json_schema", "schema": BROKEN}})
    assert messages.value.body["error"]["type"] == "invalid_request_error"
    assert "output_config.format" in messages.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as shape:
        gpt.chat.completions.create(model="m", messages=ASK, max_tokens=8, response_format={"type": "yaml"})
    assert shape.value.body["param"] == "response_format.type"


def test_the_agents_api_takes_a_response_format(url: str) -> None:
    schema = PET_SCHEMA
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/v1/agents", json={"agent_id": "shaper"}).status_code in (200, 201)
        reply = client.post("/v1/agents/shaper/messages", json={
            "content": "Describe a pet.", "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        jsonschema.validate(json.loads(body["content"]), schema)
