"""Strict tools and a forced tool_choice: the reply's tool calls follow the tools' schemas.

The grammar (``engine/formats/tools/grammar.py``) byte by byte on a byte tokenizer; when a turn is
constrained at all (``engine/formats/tools/constraints.py``); and over HTTP on a tiny random-weight llama that
samples: whatever it samples, a forced strict call parses and validates, in each protocol, through the
official SDKs unmodified.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator

import anthropic
import jsonschema
import llguidance
import numpy as np
import openai
import pytest

from engine.formats.tools.calls import FALLBACK, ToolFormat, tool_format_for
from engine.formats.tools.constraints import reply_format
from engine.domain.chat import ChatMessage, Conversation, ToolSpec
from engine.domain.output_format import OutputFormat
from engine.formats.tools.grammar import tool_call_grammar
from tests.support.byte_tokenizer import EOS, ByteTokenizer
from tests.support.router_app import tiny_llama_api

pytestmark = pytest.mark.unit

# Bounded (an enum, short strings, a small integer), closed: a random model's call always fits max_tokens.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
         "required": ["zone"], "additionalProperties": False}
W = ToolSpec("get_weather", "The weather in a city.", WEATHER, strict=True)
C = ToolSpec("clock", "The time in a zone.", CLOCK)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
OTHER = '<tool_call>\n{"name": "clock", "arguments": {"anything": [1]}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'


def _feed(grammar: str, text: str) -> str:
    """``ok`` with what may follow, or where the grammar refused the text."""
    table = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer()), eos_token=[EOS])
    matcher = llguidance.LLMatcher(table, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for at, byte in enumerate(text.encode()):
        if not matcher.consume_token(byte):
            return f"refused at {at}"
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return "ok, may end" if bits[EOS] and matcher.is_accepting() else "ok, unfinished"


@pytest.mark.parametrize("text, auto, forced", [
    ("Hello <b>there</b>", "ok, may end", "refused at 0"),
    ("Sure. " + CALL, "ok, may end", "refused at 0"),
    (CALL, "ok, may end", "ok, may end"),
    (CALL + "\n" + OTHER, "ok, may end", "ok, may end"),  # the non-strict tool takes any object
    (BAD, "refused at 51", "refused at 51"),  # the "t" of "town": not a property of the strict schema
    (CALL + " and more text", "refused at 93", "refused at 93"),  # nothing but calls after a call
    (CALL[:40], "ok, unfinished", "ok, unfinished"),
    (CALL + "\n\nUser:", "ok, may end", "ok, may end"),  # a turn-ending marker may follow the calls
])
def test_the_grammar_allows_text_or_calls_and_refuses_bad_arguments(text: str, auto: str, forced: str) -> None:
    for is_forced, expected in ((False, auto), (True, forced)):
        grammar = tool_call_grammar([W, C], "<tool_call>", "</tool_call>", forced=is_forced, endings=["\n\nUser:"])
        assert _feed(grammar, text) == expected, (is_forced, text)


def test_without_parallel_calls_one_call_ends_the_reply() -> None:
    grammar = tool_call_grammar([W, C], "<tool_call>", "</tool_call>", forced=False, parallel=False)
    assert _feed(grammar, CALL) == "ok, may end"
    assert _feed(grammar, CALL + "\n" + OTHER) == "refused at 93"


def test_with_a_response_format_the_reply_is_that_json_or_calls() -> None:
    answer = OutputFormat.from_schema({"type": "object", "properties": {"x": {"type": "integer"}},
                                       "required": ["x"], "additionalProperties": False})
    grammar = tool_call_grammar([W], "<tool_call>", "</tool_call>", forced=False, answer=answer)
    assert _feed(grammar, '{"x": 3}') == "ok, may end"
    assert _feed(grammar, CALL) == "ok, may end"
    assert _feed(grammar, "Plain words") == "refused at 0"
    assert _feed(grammar, '{"y": 3}') == "refused at 2"


def test_markers_with_regex_and_lark_metacharacters_are_literal() -> None:
    start, end = "<|tool_call_start|>", "<|tool_call/end|>"
    grammar = tool_call_grammar([W], start, end, forced=False)
    call = f'{start}\n{{"name": "get_weather", "arguments": {{"city": "P", "unit": "f"}}}}\n{end}'
    assert _feed(grammar, "a|b [x] (y) /z/ .* <tool_call_start") == "ok, may end"
    assert _feed(grammar, "Calling. " + call) == "ok, may end"


def _conversation(*tools: ToolSpec, choice: str = "auto") -> Conversation:
    return Conversation((ChatMessage("user", "hi"),), tools, choice)


def test_when_a_turn_with_tools_is_constrained() -> None:
    answer = OutputFormat.any_object()
    assert reply_format(_conversation(C), None, FALLBACK) is None  # nothing strict, nothing forced: free
    assert reply_format(_conversation(C), answer, FALLBACK) is not None and \
        reply_format(_conversation(C), answer, FALLBACK).lark  # type: ignore[union-attr]
    assert reply_format(_conversation(), answer, FALLBACK) is answer  # no tools: the response format alone
    assert reply_format(_conversation(W, C, choice="none"), None, FALLBACK) is None
    strict = reply_format(_conversation(W, C), None, FALLBACK)
    forced = reply_format(_conversation(C, choice="any"), None, FALLBACK)
    named = reply_format(_conversation(W, C, choice="clock"), None, FALLBACK)
    assert strict is not None and forced is not None and named is not None
    assert strict.key != forced.key
    assert '"get_weather"' not in named.lark and '"clock"' in named.lark  # a named choice narrows the calls


def test_a_format_whose_calls_are_not_json_is_left_free_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    pythonic = ToolFormat("[", "]", lambda text, tools: {}, json_body=False)
    with caplog.at_level(logging.WARNING):
        assert reply_format(_conversation(W), None, pythonic) is None
    assert "not enforced" in caplog.text


def test_mlx_lm_json_tools_parser_is_a_json_format() -> None:
    from mlx_lm.tool_parsers import json_tools

    class Templated:
        has_tool_calling, tool_call_start, tool_call_end = True, "<tool_call>", "</tool_call>"
        tool_parser = staticmethod(json_tools.parse_tool_call)

    assert tool_format_for(Templated()).json_body
    assert tool_format_for(ByteTokenizer()) is FALLBACK


# -- over HTTP, sampled by a random model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from tiny_llama_api(tmp_path_factory.mktemp("strict-tools"))


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANTHROPIC_TOOLS: list[Any] = [
    {"name": "get_weather", "description": "The weather.", "input_schema": WEATHER, "strict": True},
    {"name": "clock", "description": "The time.", "input_schema": CLOCK}]
OPENAI_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "clock", "parameters": CLOCK, "strict": True}}]


def _valid(name: str, arguments: dict[str, Any]) -> None:
    assert name in ("get_weather", "clock")
    jsonschema.validate(arguments, WEATHER if name == "get_weather" else CLOCK)


def test_anthropic_forced_strict_calls_validate_whatever_the_model_samples(url: str) -> None:
    claude = anthropic.Anthropic(api_key="any", base_url=url, max_retries=0, timeout=60)
    for seed in range(4):
        message = claude.messages.create(model="claude-x", max_tokens=160, messages=ASK,
                                         tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather",
                                                                             "disable_parallel_tool_use": True},
                                         metadata={"user_id": f"seed-{seed}"})
        assert message.stop_reason == "tool_use", message
        calls = [block for block in message.content if block.type == "tool_use"]
        assert [call.name for call in calls] == ["get_weather"]  # one call: no parallel calls asked for
        jsonschema.validate(calls[0].input, WEATHER)


def test_openai_chat_and_responses_forced_calls_validate(url: str) -> None:
    gpt = openai.OpenAI(api_key="any", base_url=f"{url}/v1", max_retries=0, timeout=60)
    for seed in range(3):
        chat = gpt.chat.completions.create(model="m", messages=ASK, max_tokens=160, seed=seed, temperature=1.0,
                                           tools=OPENAI_TOOLS, tool_choice="required", parallel_tool_calls=False)
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls or []) == 1
        call = (choice.message.tool_calls or [])[0]
        _valid(call.function.name, json.loads(call.function.arguments))
    tools: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]  # strict by default
    response = gpt.responses.create(model="m", input="Weather in Paris?", tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=160, temperature=1.0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_auto_choice_with_a_strict_tool_gives_text_or_valid_calls(url: str) -> None:
    claude = anthropic.Anthropic(api_key="any", base_url=url, max_retries=0, timeout=60)
    for _ in range(4):
        message = claude.messages.create(model="claude-x", max_tokens=160, messages=ASK,
                                         tools=ANTHROPIC_TOOLS)
        for block in message.content:
            if block.type == "tool_use":
                if block.name == "get_weather":  # (clock is not strict here: any object)
                    jsonschema.validate(block.input, WEATHER)
            elif message.stop_reason != "max_tokens":  # (a call cut short by max_tokens comes back as text)
                assert "<tool_call>" not in block.text  # a call written whole is a call, never text
        assert message.stop_reason in ("tool_use", "end_turn", "max_tokens")


def test_a_strict_tool_whose_schema_cannot_compile_is_a_400_naming_it(url: str) -> None:
    broken = {"type": "object", "properties": {"a": {"type": "strin"}}}
    claude = anthropic.Anthropic(api_key="any", base_url=url, max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(model="claude-x", max_tokens=8, messages=ASK, tools=[
            ANTHROPIC_TOOLS[1], {"name": "bad", "input_schema": broken, "strict": True}])
    assert messages.value.body["error"]["type"] == "invalid_request_error"
    assert "tools[1]" in messages.value.body["error"]["message"]
    gpt = openai.OpenAI(api_key="any", base_url=f"{url}/v1", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as chat:
        gpt.chat.completions.create(model="m", messages=ASK, max_tokens=8, tools=[
            {"type": "function", "function": {"name": "bad", "parameters": broken, "strict": True}}])
    assert chat.value.body["param"] == "tools[0]" and "strin" in chat.value.body["message"]
    # A bad response format beside good tools is named as the response format, not as the tools.
    with pytest.raises(openai.BadRequestError) as beside:
        gpt.chat.completions.create(model="m", messages=ASK, max_tokens=8, tools=OPENAI_TOOLS, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": broken}})
    assert beside.value.body["param"] == "response_format"
    # Not strict, not forced: the schema is only shown to the model, as before.
    ok = gpt.chat.completions.create(model="m", messages=ASK, max_tokens=8, tools=[
        {"type": "function", "function": {"name": "bad", "parameters": broken}}])
    assert ok.choices[0].finish_reason in ("stop", "length", "tool_calls")
