"""The official ``anthropic`` and ``openai`` SDKs against the real server on the real SmolLM2.

What a unit test with a scripted engine cannot show: the SDKs parse the real
responses (usage split, SSE grammar, typed errors) of real generations, and
the usage numbers agree with the real tokenizer's count and with the reuse
the engine really did.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Iterator

import anthropic
import openai
import pytest
from pydantic import SecretStr

from tests.model.real_api import RealApi, extra_app, running_api

QUESTION = "What is the capital of France?"
# Any model name is answered by the loaded model and echoed back.
MODEL = "claude-opus-4-1"
# Over 32 tokens: shorter limits mark a request as a Claude Code side request.
MAX_TOKENS = 40
CONTEXT = 8192
API_KEY = "sk-semantic-test-key"


@pytest.fixture(scope="module")
def api(smollm2, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApi]:
    with running_api(smollm2, tmp_path_factory.mktemp("sdk-cache"), smollm2_path) as running:
        yield running


@pytest.fixture(scope="module")
def claude(api: RealApi) -> anthropic.Anthropic:
    # No retries: an error must surface as the exception it is, at once.
    return anthropic.Anthropic(api_key="any", base_url=api.url, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def gpt(api: RealApi) -> openai.OpenAI:
    return openai.OpenAI(api_key="any", base_url=f"{api.url}/v1", max_retries=0, timeout=120)


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def prompt_total(usage: anthropic.types.Usage) -> int:
    """The whole prompt as Anthropic splits it: prefilled + read from cache + written to cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# -- Anthropic -------------------------------------------------------------------------------------
def test_anthropic_create_answers_the_question(claude: anthropic.Anthropic) -> None:
    # Greedy: the answer is checked for a fact, and without a temperature the model's defaults sample.
    message = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=ask(QUESTION),
                                     extra_body={"temperature": 0})  # this SDK version has no temperature argument
    assert "Paris" in text_of(message)
    assert message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0


def test_anthropic_stream_usage_adds_up_to_count_tokens(claude: anthropic.Anthropic) -> None:
    request = {"model": MODEL, "system": "You are a geography teacher. Answer in one sentence.",
               "messages": ask("Which river flows through Paris?")}
    with claude.messages.stream(max_tokens=MAX_TOKENS, **request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    counted = claude.messages.count_tokens(**request).input_tokens
    assert text.strip() and text == text_of(final)
    assert prompt_total(final.usage) == counted
    assert final.usage.output_tokens > 0


def test_anthropic_second_turn_reads_the_first_turn_from_cache(api: RealApi) -> None:
    session = anthropic.Anthropic(api_key="any", base_url=api.url, max_retries=0, timeout=120,
                                  default_headers={"X-Claude-Code-Session-Id": str(uuid.uuid4())})
    history = ask("Name a fruit that is yellow.")
    first = session.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=history)
    history += [{"role": "assistant", "content": text_of(first)}, {"role": "user", "content": "And one that is red?"}]
    second = session.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=history)
    print(f"\nturn 1 usage {first.usage}\nturn 2 usage {second.usage}")
    assert (second.usage.cache_read_input_tokens or 0) >= prompt_total(first.usage)
    assert prompt_total(second.usage) > prompt_total(first.usage)


def test_anthropic_prompt_longer_than_the_context_is_a_bad_request(claude: anthropic.Anthropic) -> None:
    # Rejected before any prefill, so a huge prompt costs only its tokenization.
    messages = ask("hello " * (CONTEXT + 1000))
    counted = claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=messages)
    error = caught.value
    assert error.status_code == 400
    assert error.body["error"]["type"] == "invalid_request_error"
    # The exact wording is what makes Claude Code compact its conversation.
    match = re.search(r"prompt is too long: (\d+) tokens > (\d+) maximum", error.body["error"]["message"])
    assert match, error.body
    assert (int(match[1]), int(match[2])) == (counted, CONTEXT)


def test_anthropic_wrong_api_key_is_an_authentication_error(api: RealApi) -> None:
    with extra_app(api, api_key=SecretStr(API_KEY)) as locked:
        right = anthropic.Anthropic(api_key=API_KEY, base_url=locked.url, max_retries=0, timeout=60)
        assert right.messages.count_tokens(model=MODEL, messages=ask(QUESTION)).input_tokens > 0
        wrong = anthropic.Anthropic(api_key="not-the-key", base_url=locked.url, max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=ask(QUESTION))
    assert caught.value.status_code == 401
    assert caught.value.body["error"]["type"] == "authentication_error"


# -- OpenAI ----------------------------------------------------------------------------------------
def test_openai_create_answers_the_question(gpt: openai.OpenAI) -> None:
    completion = gpt.chat.completions.create(model="gpt-4o", max_tokens=MAX_TOKENS, temperature=0,
                                             messages=ask(QUESTION))
    choice = completion.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_openai_stream_ends_with_a_usage_chunk(gpt: openai.OpenAI) -> None:
    chunks = list(gpt.chat.completions.create(
        model="gpt-4o", max_tokens=MAX_TOKENS, messages=ask("Name three colours."),
        stream=True, stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip()
    assert finishes in (["stop"], ["length"])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens > 0
    assert len({(c.id, c.created) for c in chunks}) == 1


def test_openai_session_id_reuses_the_first_turn(gpt: openai.OpenAI) -> None:
    session = {"session_id": f"sdk-test-{uuid.uuid4().hex[:12]}"}
    history = ask("Name a planet.")
    first = gpt.chat.completions.create(model="gpt-4o", max_tokens=MAX_TOKENS, messages=history, extra_body=session)
    history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "And another one?"}]
    second = gpt.chat.completions.create(model="gpt-4o", max_tokens=MAX_TOKENS, messages=history, extra_body=session)
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    print(f"\nturn 1 usage {first.usage}\nturn 2 usage {second.usage}")
    assert details is not None and details.cached_tokens >= first.usage.prompt_tokens


def test_openai_invalid_field_is_a_bad_request(gpt: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gpt.chat.completions.create(model="gpt-4o", max_tokens=MAX_TOKENS, messages=ask(QUESTION), temperature=7)
    error = caught.value
    assert error.status_code == 400
    assert "temperature" in error.message
    assert isinstance(error.body, dict) and error.body.get("type") == "invalid_request_error"
