"""A thinking model's reasoning through every protocol, streaming and not, with the official SDKs unmodified.

The scripted engine writes exactly what each test scripts, token by token,
through the engine's own reasoning tracker and routed text (markers are
single tokens of a MarkerTokenizer, as a real tokenizer's added tokens are);
what the client gets is checked to the character.
"""

from __future__ import annotations

import json
from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from engine.api.reasoning_signature import reasoning_of, sign
from tests.support.marker_tokenizer import HARMONY, MarkerTokenizer
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded

pytestmark = pytest.mark.unit

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
THINKING = "The user greets me; I answer briefly."
ANSWER = "Hello!"
MARKUP = ("<think>", "</think>", "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>")


class Served:
    def __init__(self, server: LiveServer, engine: ScriptedEngine) -> None:
        self.server, self.engine = server, engine

    def prompt(self, index: int = -1) -> str:
        return self.engine.loaded.tokenizer.decode(list(self.engine.requests[index].prompt_tokens))


@pytest.fixture(scope="module")
def thinking(tmp_path_factory) -> Iterator[Served]:
    engine = ScriptedEngine(script=lambda r: f"{THINKING}</think>{ANSWER}",
                            loaded=scripted_loaded(tokenizer=MarkerTokenizer()))
    with LiveServer(build_app(make_service(tmp_path_factory.mktemp("thinking"), engine))) as server:
        yield Served(server, engine)


@pytest.fixture
def served(thinking: Served) -> Served:
    thinking.engine.script = lambda r: f"{THINKING}</think>{ANSWER}"
    return thinking


@pytest.fixture
def claude(served: Served) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=served.server.url, api_key="k", max_retries=0) as client:
        yield client


@pytest.fixture
def gpt(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="k", max_retries=0)


def no_markup(*texts: str) -> None:
    for text in texts:
        assert not any(marker in text for marker in MARKUP), text


# -- Anthropic ------------------------------------------------------------------------------------
def test_anthropic_thinking_block_comes_before_the_text_with_a_signature_that_carries_it(claude, served) -> None:
    message = claude.messages.create(model="claude-opus-5-5", max_tokens=200,
                                     thinking={"type": "enabled", "budget_tokens": 100},
                                     messages=[{"role": "user", "content": "Hi"}])
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == THINKING and message.content[1].text == ANSWER
    assert reasoning_of(message.content[0].signature) == THINKING
    # Thinking tokens count in output_tokens: the reasoning, the end marker, the answer (byte tokens) and the EOS.
    assert message.usage.output_tokens == len(THINKING) + 1 + len(ANSWER) + 1
    assert served.prompt().endswith("<assistant><think>")  # the template opened the reasoning


def test_anthropic_stream_sends_thinking_deltas_then_one_signature_delta(claude) -> None:
    kinds, thinking = [], []
    with claude.messages.stream(model="claude-opus-5-5", max_tokens=200,
                                thinking={"type": "enabled", "budget_tokens": 100},
                                messages=[{"role": "user", "content": "Hi"}]) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
                if event.delta.type == "thinking_delta":
                    thinking.append(event.delta.thinking)
        final = stream.get_final_message()
    first_text = kinds.index("text_delta")
    assert set(kinds[:first_text]) == {"thinking_delta", "signature_delta"} and kinds[first_text - 1] == "signature_delta"
    assert "".join(thinking) == THINKING
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == ANSWER
    assert reasoning_of(final.content[0].signature) == THINKING


def test_display_omitted_withholds_the_text_and_the_block_sent_back_renders_it_again(claude, served) -> None:
    first = claude.messages.create(model="claude-opus-5-5", max_tokens=2000,
                                   thinking={"type": "adaptive", "display": "omitted"},
                                   output_config={"effort": "low"},
                                   messages=[{"role": "user", "content": "Hi"}])
    block = first.content[0]
    assert block.type == "thinking" and block.thinking == "" and reasoning_of(block.signature) == THINKING
    claude.messages.create(model="claude-opus-5-5", max_tokens=200, thinking={"type": "adaptive", "display": "omitted"},
                           messages=[{"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                                     {"role": "user", "content": "Again"}])
    assert f"<assistant><think>{THINKING}</think>{ANSWER}\n<user>Again" in served.prompt()
    assert served.engine.requests[-2].reasoning_budget == 1024  # effort low
    assert served.engine.requests[-1].reasoning_budget == 150  # Anthropic's default effort, high: 3/4 of max_tokens


def test_a_signature_that_is_not_ours_is_used_as_given(claude, served) -> None:
    claude.messages.create(model="m", max_tokens=100, messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "given", "signature": "EqQBCkgIARAB"},
                                          {"type": "text", "text": "Yo"}]},
        {"role": "user", "content": "Again"}])
    assert "<think>given</think>Yo" in served.prompt()
    assert reasoning_of(sign("x")[:-2] + "00") is None  # a damaged one of ours does not verify either


def test_disabled_thinking_renders_the_no_thinking_prompt(claude, served) -> None:
    served.engine.script = lambda r: ANSWER
    message = claude.messages.create(model="m", max_tokens=100, thinking={"type": "disabled"},
                                     messages=[{"role": "user", "content": "Hi"}])
    assert served.prompt().endswith("<assistant><think></think>")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == ANSWER


def test_a_budget_holds_exactly_and_the_answer_follows(claude, served) -> None:
    served.engine.script = lambda r: "x" * 500 + "</think>" + ANSWER
    message = claude.messages.create(model="m", max_tokens=400, thinking={"type": "enabled", "budget_tokens": 37},
                                     messages=[{"role": "user", "content": "Hi"}])
    assert message.content[0].thinking == "x" * 37 and message.content[1].text == ANSWER


def test_a_tool_call_marker_inside_reasoning_is_not_a_call(claude, served) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    served.engine.script = lambda r: f"maybe {call}</think>No call needed."
    message = claude.messages.create(model="m", max_tokens=300, tools=[WEATHER],
                                     messages=[{"role": "user", "content": "Hi"}])
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == f"maybe {call}" and message.stop_reason == "end_turn"
    served.engine.script = lambda r: f"I will call.</think>{call}"
    called = claude.messages.create(model="m", max_tokens=300, tools=[WEATHER],
                                    messages=[{"role": "user", "content": "Hi"}])
    assert [b.type for b in called.content] == ["thinking", "tool_use"] and called.stop_reason == "tool_use"


@pytest.mark.parametrize(("asked", "extra", "field"), [
    ({"type": "enabled", "budget_tokens": 200}, {}, "thinking.budget_tokens"),
    ({"type": "adaptive"}, {"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"type": "sometimes"}, {}, "thinking.type"),
])
def test_bad_thinking_is_a_400_naming_the_field(served, asked, extra, field) -> None:
    response = httpx.post(f"{served.server.url}/v1/messages", json={
        "model": "m", "max_tokens": 200, "thinking": asked, "messages": [{"role": "user", "content": "Hi"}], **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"]


# -- OpenAI chat completions ----------------------------------------------------------------------
def test_chat_completion_carries_reasoning_content_and_reasoning(gpt) -> None:
    completion = gpt.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    message = completion.choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == THINKING and message.reasoning == THINKING  # type: ignore[attr-defined]
    assert completion.usage.completion_tokens_details.reasoning_tokens == len(THINKING)


def test_chat_stream_sends_reasoning_deltas_before_content(gpt) -> None:
    reasoning, content = [], []
    for chunk in gpt.chat.completions.create(model="m", stream=True, messages=[{"role": "user", "content": "Hi"}]):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            assert not content
            reasoning.append(delta.reasoning_content)  # type: ignore[attr-defined]
        if delta.content:
            content.append(delta.content)
    assert "".join(reasoning) == THINKING and "".join(content) == ANSWER


def test_reasoning_effort_none_and_template_kwargs_turn_it_off(gpt, served) -> None:
    served.engine.script = lambda r: ANSWER
    gpt.chat.completions.create(model="m", reasoning_effort="none", messages=[{"role": "user", "content": "Hi"}])
    assert served.prompt().endswith("<think></think>") and served.engine.requests[-1].reasoning_budget == 0
    gpt.chat.completions.create(model="m", extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                messages=[{"role": "user", "content": "Hi"}])
    assert served.prompt().endswith("<think></think>")
    with pytest.raises(openai.BadRequestError) as caught:
        gpt.chat.completions.create(model="m", reasoning_effort="hard",  # type: ignore[arg-type]
                                    messages=[{"role": "user", "content": "Hi"}])
    assert "reasoning_effort" in caught.value.message


def test_chat_history_reasoning_content_goes_back_to_the_template(gpt, served) -> None:
    gpt.chat.completions.create(model="m", messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo", "reasoning_content": "thought"},  # type: ignore[misc]
        {"role": "user", "content": "Again"}])
    assert "<assistant><think>thought</think>Yo\n" in served.prompt()


# -- Responses ------------------------------------------------------------------------------------
def test_responses_reasoning_item_with_encrypted_content(gpt) -> None:
    response = gpt.responses.create(model="m", input="Hi", reasoning={"effort": "low"},
                                    include=["reasoning.encrypted_content"])
    assert [item.type for item in response.output] == ["reasoning", "message"]
    item = response.output[0]
    assert item.content[0].type == "reasoning_text" and item.content[0].text == THINKING
    assert reasoning_of(item.encrypted_content) == THINKING
    assert response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens == len(THINKING)


def test_responses_stream_sends_reasoning_text_deltas(gpt) -> None:
    deltas, kinds = [], []
    with gpt.responses.stream(model="m", input="Hi") as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == THINKING
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_responses_reasoning_items_sent_back_rebuild_the_history(gpt, served) -> None:
    """Codex replays what it received with store: false; an item with only encrypted_content renders its text."""
    first = gpt.responses.create(model="m", input="Hi", store=False, include=["reasoning.encrypted_content"])
    replay = [item.model_dump(exclude_none=True) for item in first.output]
    replay[0].pop("content")
    gpt.responses.create(model="m", store=False, input=[{"role": "user", "content": "Hi"}, *replay,
                                                        {"role": "user", "content": "Again"}])
    assert f"<assistant><think>{THINKING}</think>{ANSWER}\n<user>Again" in served.prompt()


# -- the direct agent API -------------------------------------------------------------------------
def test_agent_api_streams_reasoning_events_and_keeps_the_reasoning_in_the_history(served) -> None:
    url = served.server.url
    httpx.post(f"{url}/v1/agents", json={"agent_id": "thinker"}).raise_for_status()
    with httpx.stream("POST", f"{url}/v1/agents/thinker/messages", json={"content": "Hi", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith(("event:", "data:"))]
    events = [(lines[i][7:], json.loads(lines[i + 1][6:])) for i in range(0, len(lines), 2)]
    assert "".join(d["text"] for e, d in events if e == "reasoning") == THINKING
    assert "".join(d["text"] for e, d in events if e == "token") == ANSWER
    done = events[-1][1]
    assert done["reasoning"] == THINKING and done["usage"]["reasoning_tokens"] == len(THINKING)
    httpx.post(f"{url}/v1/agents/thinker/messages", json={"content": "Again"}).raise_for_status()
    assert f"<think>{THINKING}</think>{ANSWER}\n<user>Again" in served.prompt()


# -- harmony (gpt-oss) ----------------------------------------------------------------------------
CALL_SCRIPT = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
               "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
               "<|message|>{\"city\": \"Oslo\"}<|call|>")


@pytest.fixture(scope="module")
def harmony(tmp_path_factory) -> Iterator[Served]:
    tokenizer = MarkerTokenizer(HARMONY, stop=("<|call|>", "<|return|>"))
    engine = ScriptedEngine(script=lambda r: CALL_SCRIPT, loaded=scripted_loaded(tokenizer=tokenizer))
    with LiveServer(build_app(make_service(tmp_path_factory.mktemp("harmony"), engine))) as server:
        yield Served(server, engine)


def test_harmony_call_on_commentary_is_a_tool_use_and_no_markup_leaks(harmony) -> None:
    with anthropic.Anthropic(base_url=harmony.server.url, api_key="k", max_retries=0) as claude:
        message = claude.messages.create(model="m", max_tokens=300, tools=[WEATHER],
                                         messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == "Need the weather."
    assert (message.content[1].name, message.content[1].input) == ("get_weather", {"city": "Oslo"})
    assert message.stop_reason == "tool_use"
    gpt = openai.OpenAI(base_url=f"{harmony.server.url}/v1", api_key="k", max_retries=0)
    harmony.engine.script = lambda r: "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant" \
                                      "<|channel|>final<|message|>Sunny.<|return|>"
    completion = gpt.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather?"}])
    message = completion.choices[0].message
    assert message.content == "Sunny." and message.reasoning_content == "Easy."  # type: ignore[attr-defined]
    no_markup(message.content, message.reasoning_content)  # type: ignore[attr-defined]
    assert harmony.prompt().endswith("<|start|>assistant")


def test_claude_codes_keep_all_thinking_reaches_templates_that_have_the_switch() -> None:
    """Claude Code asks ``clear_thinking`` to keep all; GLM's template reads ``clear_thinking``, Gemma 4's
    ``preserve_thinking``: both go to the template with every render (a template without them ignores them)."""
    from engine.api.anthropic_schemas import MessagesRequest
    from engine.api.anthropic_translate import conversation_of, turn_spec
    from engine.formats.rendering import PromptRenderer

    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 32000, "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"}, "messages": [{"role": "user", "content": "Hi"}],
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    spec = turn_spec(body, {})
    assert dict(spec.conversation.template_kwargs) == {"clear_thinking": False, "preserve_thinking": True}
    assert spec.reasoning.budget == 4096 and spec.reasoning.omitted
    assert conversation_of(body).template_kwargs == spec.conversation.template_kwargs  # count_tokens renders alike
    seen = {}

    class Recording(MarkerTokenizer):
        def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True, **kwargs):
            seen.update(kwargs)
            return super().apply_chat_template(messages, tokenize, add_generation_prompt, **kwargs)

    PromptRenderer(Recording()).render(spec.conversation)
    assert seen["clear_thinking"] is False and seen["preserve_thinking"] is True


def test_a_reply_sent_back_without_its_thinking_block_gets_its_reasoning_from_the_agents_record(claude, served) -> None:
    """Claude Code 2.1.197 sends earlier replies back with no thinking block at all, even in a tool loop; the
    template still renders the loop's reasoning, so the server gives back what that reply reasoned."""
    served.engine.script = lambda r: f"{THINKING}</think>Let me look."
    headers = {"X-Claude-Code-Session-Id": "recall-1"}
    first = claude.messages.create(model="m", max_tokens=200, tools=[WEATHER], extra_headers=headers,
                                   messages=[{"role": "user", "content": "Weather in Oslo?"}])
    text = next(b.text for b in first.content if b.type == "text")
    claude.messages.create(model="m", max_tokens=200, tools=[WEATHER], extra_headers=headers, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "text", "text": text}]},  # no thinking block
        {"role": "user", "content": "Go on."}])
    assert f"<think>{THINKING}</think>Let me look.\n<user>Go on." in served.prompt()
    # Another agent's identical reply is not this agent's record.
    claude.messages.create(model="m", max_tokens=200, tools=[WEATHER], extra_headers={"X-Claude-Code-Session-Id": "b"},
                           messages=[{"role": "user", "content": "Weather in Oslo?"},
                                     {"role": "assistant", "content": [{"type": "text", "text": text}]},
                                     {"role": "user", "content": "Go on."}])
    assert "<think>" not in served.prompt().split("<assistant>")[1]

