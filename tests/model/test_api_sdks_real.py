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
from tests.support.reference import reference_greedy

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


def test_concurrent_requests_without_a_session_run_side_by_side_on_sibling_lanes(gpt: openai.OpenAI,
                                                                               api: RealApi) -> None:
    """A script that names no session sends the same prompt from three threads: one agent (the prompt's prefix
    hash) ran them one after another; now they share the batch on lanes of that agent, answer alike (greedy),
    and the lanes are free again afterwards."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    question = [{"role": "system", "content": f"Lanes {uuid.uuid4().hex[:8]}."}, *ask("Count to twenty.")]
    first_token: list[float] = []
    lock = threading.Lock()

    def one(_: int) -> tuple[str, str, float]:
        stream = gpt.chat.completions.with_raw_response.create(model="gpt-4o", max_tokens=32, temperature=0,
                                                               messages=question, stream=True)
        text = ""
        for chunk in stream.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if not text:
                    with lock:
                        first_token.append(time.monotonic())
                text += chunk.choices[0].delta.content
        return stream.headers["x-semantic-agent-id"], text, time.monotonic()

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(one, range(3)))
    agents = sorted(agent for agent, _, _ in replies)
    assert len(set(agents)) == 3 and agents[1:] == [f"{agents[0]}-2", f"{agents[0]}-3"], agents
    assert len({text for _, text, _ in replies}) == 1 and replies[0][1]
    # Side by side: every reply had begun before the first one ended (one after another, none had).
    assert max(first_token) < min(ended for _, _, ended in replies), (first_token, replies)
    assert api.app.state.service.lanes.held == 0
    again = gpt.chat.completions.with_raw_response.create(model="gpt-4o", max_tokens=32, temperature=0,
                                                          messages=question)
    assert again.headers["x-semantic-agent-id"] == agents[0]


def test_openai_invalid_field_is_a_bad_request(gpt: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gpt.chat.completions.create(model="gpt-4o", max_tokens=MAX_TOKENS, messages=ask(QUESTION), temperature=7)
    error = caught.value
    assert error.status_code == 400
    assert "temperature" in error.message
    assert isinstance(error.body, dict) and error.body.get("type") == "invalid_request_error"


# -- OpenAI Responses API ----------------------------------------------------------------------------
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_openai_text_completion_continues_mid_line_as_mlx_lm_does(gpt: openai.OpenAI, smollm2) -> None:
    """A raw prompt that stops mid-sentence: the continuation is plain mlx-lm's, greedy, token for token, and
    its text begins with the blank its first token carries (a chat reply drops it; a continuation cannot)."""
    prompt_text = "The three primary colors are"
    completion = gpt.completions.create(model=MODEL, prompt=prompt_text, max_tokens=12, temperature=0)
    eos = set(smollm2.eos_token_ids)
    prompt = smollm2.tokenizer.encode(prompt_text)
    expected = [t for t in reference_greedy(smollm2.model, prompt, 12, eos) if t not in eos]
    before = smollm2.tokenizer.decode(prompt)
    continuation = smollm2.tokenizer.decode(prompt + expected)[len(before):]
    assert continuation.startswith(" ")  # (the case this is about)
    assert completion.choices[0].text == continuation
    assert completion.usage is not None and completion.usage.completion_tokens == len(expected)


def test_responses_create_and_stream(gpt: openai.OpenAI) -> None:
    created = gpt.responses.create(model="gpt-5", input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    assert created.status in ("completed", "incomplete") and "Paris" in created.output_text
    assert created.usage is not None and created.usage.output_tokens > 0
    # Greedy and room to finish: the SDK's get_final_response() wants response.completed, and a reply cut
    # at max_output_tokens ends with response.incomplete instead (as OpenAI's own server does).
    with gpt.responses.stream(model="gpt-5", input="Name three colours.", max_output_tokens=200,
                              temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.output_text.strip()
    assert final.usage is not None and final.usage.output_tokens > 0
    assert gpt.responses.retrieve(final.id).output_text == final.output_text


def test_responses_previous_response_id_reads_the_chain_from_cache(gpt: openai.OpenAI) -> None:
    turn = gpt.responses.create(model="gpt-5", input="Name a planet.", max_output_tokens=MAX_TOKENS)
    for question in ("And another one?", "Which of them is bigger?"):
        turn = gpt.responses.create(model="gpt-5", input=question, previous_response_id=turn.id,
                                    max_output_tokens=MAX_TOKENS)
    usage = turn.usage
    assert usage is not None and usage.input_tokens_details is not None
    print(f"\nturn 3 usage {usage}")
    assert usage.input_tokens_details.cached_tokens > 0.8 * usage.input_tokens
    assert [i.content[0].text for i in gpt.responses.input_items.list(turn.id).data] == ["Which of them is bigger?"]


def test_responses_function_tool_round_trip(gpt: openai.OpenAI) -> None:
    """function_call -> function_call_output -> answer, on the real model and its cache.

    SmolLM2-135M does not call tools on its own (greedy, ten phrasings tried: it writes Python that
    defines get_weather), so the call is the client's history, as an agent resends it; the
    model-made call parsed into a function_call item is tested with a scripted model and the SDK
    (tests/unit/test_api_responses.py).
    """
    asked = gpt.responses.create(model="gpt-5", tools=[WEATHER_TOOL], temperature=0, max_output_tokens=MAX_TOKENS,
                                 input="What is the weather in Paris?")
    call = {"type": "function_call", "call_id": "call_paris", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    answered = gpt.responses.create(
        model="gpt-5", tools=[WEATHER_TOOL], previous_response_id=asked.id, temperature=0, max_output_tokens=MAX_TOKENS,
        input=[call, {"type": "function_call_output", "call_id": "call_paris", "output": "Sunny, 31 degrees Celsius."}])
    print(f"\nanswered: {answered.output_text!r} usage {answered.usage}")
    # What a 135M model makes of the result varies (it may ignore it); that it was rendered into the prompt
    # is the unit test's to check. Here: an answer, and the turn continued the first one's cache.
    assert answered.output_text.strip() and answered.status in ("completed", "incomplete")
    assert answered.usage is not None and asked.usage is not None
    assert answered.usage.input_tokens_details.cached_tokens >= asked.usage.input_tokens
    follow = gpt.responses.create(model="gpt-5", tools=[WEATHER_TOOL], previous_response_id=answered.id,
                                  temperature=0, max_output_tokens=MAX_TOKENS, input="Should I take an umbrella?")
    assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens > 0.8 * follow.usage.input_tokens
    kinds = [i.type for i in gpt.responses.input_items.list(answered.id, order="asc").data]
    assert kinds == ["function_call", "function_call_output"]


def test_responses_bad_input_is_a_bad_request_and_stores_nothing(gpt: openai.OpenAI, api: RealApi) -> None:
    stored = api.settings.cache_dir / "responses"
    before = sorted(stored.glob("*.json"))
    with pytest.raises(openai.NotFoundError):
        gpt.responses.create(model="gpt-5", input="Hi", previous_response_id="resp_" + "0" * 32)
    with pytest.raises(openai.BadRequestError) as caught:
        gpt.responses.create(model="gpt-5", input=[{"type": "function_call", "name": "f", "arguments": "{}"}])
    assert caught.value.body["param"] == "input[0].call_id"
    assert sorted(stored.glob("*.json")) == before


def test_a_stored_response_continues_after_a_restart_from_its_agents_cache(
        smollm2, smollm2_path: Path, tmp_path: Path) -> None:
    """The stored response (a file) and its agent's cache (the warm tier, written at shutdown) both survive:
    the continuation after the restart is the same agent and reads the first turn from disk."""
    with running_api(smollm2, tmp_path / "cache", smollm2_path) as first_run:
        client = openai.OpenAI(api_key="any", base_url=f"{first_run.url}/v1", max_retries=0, timeout=120)
        first = client.responses.create(model="gpt-5", input="Name a planet.", max_output_tokens=MAX_TOKENS)
    with running_api(smollm2, tmp_path / "cache", smollm2_path) as second_run:
        client = openai.OpenAI(api_key="any", base_url=f"{second_run.url}/v1", max_retries=0, timeout=120)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        again = client.responses.create(model="gpt-5", input="And another one?", previous_response_id=first.id,
                                        max_output_tokens=MAX_TOKENS)
        agents = {a["agent_id"]: a for a in second_run.stats()["agents"]}
    assert again.model_extra["agent_id"] == first.model_extra["agent_id"] and again.model_extra["agent_id"] in agents
    assert first.usage is not None and again.usage is not None
    print(f"\nafter the restart: {again.usage}")
    assert again.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert again.usage.model_extra["semantic"]["cache_outcome"] == "restored"


# -- Anthropic cache diagnostics (beta) --------------------------------------------------------------
DIAGNOSIS_BETA = "cache-diagnosis-2026-04-07"


def test_anthropic_cache_diagnostics_name_a_changed_date_line(claude: anthropic.Anthropic) -> None:
    """The missed tokens are the real model's: the first prompt's tokens after the changed date."""
    history = [{"role": "user", "content": "Name one colour."}]
    system = "You are terse. Today's date is 2026-11-28. Answer in one word."
    first = claude.beta.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=system, messages=history,
                                        diagnostics={"previous_message_id": None}, betas=[DIAGNOSIS_BETA])
    history += [{"role": "assistant", "content": text_of(first) or "Blue."}, {"role": "user", "content": "Another?"}]
    same = claude.beta.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=system, messages=history,
                                       diagnostics={"previous_message_id": first.id}, betas=[DIAGNOSIS_BETA])
    assert same.diagnostics is None and same.usage.cache_read_input_tokens > 0
    moved = system.replace("2026-11-28", "2026-11-29")
    with claude.beta.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, system=moved, messages=history,
                                     diagnostics={"previous_message_id": same.id}, betas=[DIAGNOSIS_BETA]) as stream:
        changed = stream.get_final_message()
    print(f"\ndiagnostics {changed.diagnostics}, usage {changed.usage}")
    reason = changed.diagnostics.cache_miss_reason
    assert reason.type == "system_changed"
    prompt = prompt_total(same.usage)
    assert 0 < reason.cache_missed_input_tokens < prompt  # the date sits a few tokens into the system prompt
    assert changed.usage.cache_read_input_tokens == prompt - reason.cache_missed_input_tokens
