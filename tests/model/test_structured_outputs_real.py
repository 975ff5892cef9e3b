"""Structured outputs on the real models: SmolLM2 (chat template) and Gemma 3 (base, plain format).

Ten schemas at once (nested objects, enums, arrays, bounded numbers, required fields) beside free-text
requests in the same batch: every reply that finished validates against its schema with ``jsonschema``.
The SDKs' own helpers work unmodified. The 50-request runs and the throughput ratio are in
``bench/bench_structured_outputs.py`` (kept reports under bench/reports/).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Literal

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.model.real_api import RealApi, running_api
import httpx

from tests.support.json_schemas import OPEN_SCHEMAS, SCHEMAS

pytestmark = pytest.mark.model


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


class Verdict(BaseModel):
    """Bounded after the Anthropic SDK's schema transform (which moves max_length and ge/le into descriptions):
    an enum and a boolean, so a sampled reply cannot ramble past max_tokens."""

    mood: Literal["happy", "sad", "calm"]
    sure: bool


@pytest.fixture(scope="module")
def smollm2_api(smollm2, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApi]:
    with running_api(smollm2, tmp_path_factory.mktemp("so-smol"), smollm2_path) as running:
        yield running


@pytest.fixture(scope="module")
def gemma3_api(gemma3, gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApi]:
    with running_api(gemma3, tmp_path_factory.mktemp("so-gemma"), gemma3_path) as running:
        yield running


def client(api: RealApi) -> openai.OpenAI:
    return openai.OpenAI(api_key="any", base_url=f"{api.url}/v1", max_retries=0, timeout=300)


def ask_all(api: RealApi, schemas: list[tuple[str, str, dict]], free: int) -> list[tuple[dict | None, object]]:
    """Every schema's request and ``free`` unconstrained ones, all at once (they share the batch)."""
    gpt = client(api)

    def one(job: tuple[str, str, dict | None]):
        key, prompt, schema = job
        response_format = ({"type": "json_schema", "json_schema": {"name": key, "schema": schema, "strict": True}}
                           if schema is not None else None)
        extra = {"response_format": response_format} if response_format else {}
        # Greedy, so the test is the same every run (the bench samples at the models' defaults, 50 requests).
        # The free rows only share the batch: as many tokens as the longest constrained reply here (52).
        return schema, gpt.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=120 if schema else 56,
            temperature=0, **extra).choices[0]

    # Distinct prompts: identical ones without a session id are one agent's turns, served one after another.
    jobs = [*schemas, *[("free", f"Tell me a short story about {topic}.", None)
                        for topic in ("a fox", "the sea", "a clock")[:free]]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def check_replies(replies: list[tuple[dict | None, object]], least_finished: int) -> None:
    finished = 0
    for schema, choice in replies:
        if schema is None:
            assert choice.message.content  # free text beside the constrained rows
            continue
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
            finished += 1
        else:
            assert choice.finish_reason == "length"  # never a "stop" that does not parse
    assert finished >= least_finished


def test_smollm2_ten_schemas_beside_free_text_all_validate(smollm2_api: RealApi) -> None:
    check_replies(ask_all(smollm2_api, SCHEMAS, free=2), least_finished=len(SCHEMAS))


def test_gemma3_schemas_beside_free_text_all_validate(gemma3_api: RealApi) -> None:
    check_replies(ask_all(gemma3_api, SCHEMAS[:5], free=1), least_finished=5)


def test_smollm2_sdk_helpers_parse_unmodified(smollm2_api: RealApi) -> None:
    parsed = client(smollm2_api).chat.completions.parse(
        model="m", messages=[{"role": "user", "content": "Describe a person."}], response_format=Person, max_tokens=80,
        temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    claude = anthropic.Anthropic(api_key="any", base_url=smollm2_api.url, max_retries=0, timeout=300)
    message = claude.messages.parse(model="claude-x", max_tokens=80, output_format=Verdict,
                                    messages=[{"role": "user", "content": "How do you feel today?"}])
    assert message.stop_reason == "end_turn" and isinstance(message.parsed_output, Verdict)


def test_smollm2_greedy_loops_in_open_schemas_close_inside_the_grammar(smollm2_api: RealApi) -> None:
    """Greedy SmolLM2 loops in unbounded arrays and strings (``"landmarks": [..., "The Statue of Liberty", "The
    Statue of Liberty", ...``): before loops were closed, these three ran to max_tokens and did not parse. Now each
    ends ``stop`` and validates, and the reply and its agent say where the loop was closed."""
    gpt = client(smollm2_api)

    def one(job: tuple[str, str, dict]):
        key, prompt, schema = job
        return gpt.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=256, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": key, "schema": schema, "strict": True}},
            extra_body={"session_id": f"open-{key}"})

    jobs = OPEN_SCHEMAS[:3]
    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(one, jobs))
    closed = []
    for (key, _, schema), response in zip(jobs, responses):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (key, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
        loop = response.usage.model_extra["semantic"]["loop_closed"]
        if loop is not None:
            closed.append(key)
            assert 0 < loop["at_token"] < response.usage.completion_tokens, loop
            assert loop["tokens_left"] == 256 - response.usage.completion_tokens and loop["why"], loop
            agent = httpx.get(f"{smollm2_api.url}/v1/agents/{response.model_extra['agent_id']}", timeout=30).json()
            assert agent["last_finish"] == "complete" and "loop in the reply's JSON was closed" in agent[
                "last_finish_note"], agent
    assert len(closed) >= 2, closed


def test_smollm2_a_long_string_about_to_run_to_max_tokens_closes_before_it(smollm2_api: RealApi) -> None:
    """Greedy SmolLM2 writing a story into a string, with room for 48 tokens: no loop to find in so few, and
    before it ran to the cap unclosed (``length``, JSON that does not parse). Now it is steered closed before the
    cap: ``stop``, valid, and the usage says the token limit closed it."""
    key, prompt, schema = next(job for job in OPEN_SCHEMAS if job[0] == "story")
    response = client(smollm2_api).chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": key, "schema": schema, "strict": True}},
        extra_body={"session_id": "near-the-cap"})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)
    closed = response.usage.model_extra["semantic"]["loop_closed"]
    assert closed is not None and closed["kind"] == "token_limit" and "tokens were left" in closed["why"], closed
    assert response.usage.completion_tokens <= 48 and closed["tokens_left"] == 48 - response.usage.completion_tokens


WEATHER_TOOL = {
    "name": "get_weather", "description": "Get the current weather in a city.", "strict": True,
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                     "required": ["city", "unit"], "additionalProperties": False}}


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_strict_tool_calls_validate_on_the_real_models(which: str, request: pytest.FixtureRequest) -> None:
    """SmolLM2 (ChatML, the Hermes fallback's tool prompt) and Gemma 3 (base, plain format) called through the
    Anthropic SDK as Claude Code's kind of client sends a strict tool: forced (streamed), the call's arguments
    arrive as written and validate; offered, the reply is text or a call that validates."""
    api: RealApi = request.getfixturevalue(f"{which}_api")
    claude = anthropic.Anthropic(api_key="any", base_url=api.url, max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "What is the weather like in Lisbon right now?"}]
    with claude.messages.stream(model="claude-x", max_tokens=120, messages=ask, tools=[WEATHER_TOOL],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        parts = [event.partial_json for event in stream if event.type == "input_json"]
        forced = stream.get_final_message()
    assert forced.stop_reason == "tool_use", forced.content
    (call,) = [block for block in forced.content if block.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER_TOOL["input_schema"])
    # The arguments streamed as the model wrote them (a token's text at a time), and they are the input.
    assert len(parts) > 3 and json.loads("".join(parts)) == call.input, parts
    offered = claude.messages.create(model="claude-x", max_tokens=120, messages=ask, tools=[WEATHER_TOOL])
    for block in offered.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, WEATHER_TOOL["input_schema"])
    assert offered.stop_reason in ("tool_use", "end_turn", "max_tokens")
