"""Tool arguments stream as the model writes them: the scanner, the call stream, and the three APIs through
the official SDKs' stream helpers on a scripted model (one character a token)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from hypothesis import given, settings, strategies as st

from engine.formats.tools.scanning import JsonCallScanner, partial_arguments
from engine.formats.tools.calls import (FALLBACK, BadToolPiece, TextPiece, ToolArgumentsPiece, ToolCallStream, ToolFormat,
                                   ToolPiece, ToolStartPiece)
from engine.api.turns import OutputAssembler
from engine.domain.reasoning import CallText
from engine.domain.requests import TokenEvent
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.unit

# A Write whose content holds what could end the call or its JSON too early: braces, quotes, an escaped
# quote, a backslash, and the start of the end marker inside a string.
CONTENT = 'def f(x):\n    return {"a": [x, "}"]}  # </tool_call is not the end\n\tpath = "C:\\\\tmp"\n'
ARGUMENTS = {"file_path": "/project/src/app.py", "content": CONTENT, "mode": {"append": False, "lines": [1, 2]}}
ARGUMENTS_TEXT = json.dumps(ARGUMENTS, indent=1)
CALL = '<tool_call>\n{"name": "Write", "arguments": ' + ARGUMENTS_TEXT + '}\n</tool_call>'
WRITE_TOOL_ANTHROPIC = {"name": "Write", "description": "Write a file.",
                        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"},
                                                                          "content": {"type": "string"}}}}
WRITE_TOOL_OPENAI = {"type": "function", "function": {"name": "Write", "description": "Write a file.",
                                                       "parameters": WRITE_TOOL_ANTHROPIC["input_schema"]}}


def fed(stream: ToolCallStream, text: str, cuts: list[int]) -> list:
    pieces, at = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces += stream.feed(text[at:cut])
        at = cut
    return pieces + stream.finish()


# -- the scanner and the call stream -----------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(CALL) + 12), max_size=40))
def test_a_json_call_streams_its_arguments_text_exactly_however_the_tokens_cut_it(cuts: list[int]) -> None:
    text = "Writing it." + CALL
    pieces = fed(ToolCallStream(FALLBACK), text, [c for c in cuts if c <= len(text)])
    kinds = [type(p) for p in pieces]
    start = kinds.index(ToolStartPiece)
    assert all(k is TextPiece for k in kinds[:start]) and "".join(p.text for p in pieces[:start]) == "Writing it."
    assert kinds[-1] is ToolPiece and set(kinds[start + 1:-1]) == {ToolArgumentsPiece}
    streamed = "".join(p.text for p in pieces[start + 1:-1])
    call = pieces[-1]
    assert streamed == ARGUMENTS_TEXT == call.arguments_text  # the model's own text, not a re-serialization
    assert call.call.arguments == ARGUMENTS == json.loads(streamed)
    assert call.call.id == pieces[start].id and call.call.name == pieces[start].name == "Write"


def test_the_arguments_begin_streaming_before_the_call_closes() -> None:
    stream = ToolCallStream(FALLBACK)
    head = CALL[:CALL.index('"content"') + 20]
    pieces = stream.feed(head)
    assert isinstance(pieces[0], ToolStartPiece) and pieces[0].name == "Write"
    assert "".join(p.text for p in pieces[1:]) == head[head.index('"arguments": ') + len('"arguments": '):]
    rest = stream.feed(CALL[len(head):]) + stream.finish()
    assert isinstance(rest[-1], ToolPiece) and rest[-1].call.arguments == ARGUMENTS


@pytest.mark.parametrize("body", [
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',  # the arguments before the name
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments as a string of JSON
])
def test_a_call_that_cannot_stream_comes_whole_when_it_closes(body: str) -> None:
    pieces = fed(ToolCallStream(FALLBACK), f"<tool_call>{body}</tool_call>", list(range(0, 80, 3)))
    assert [type(p) for p in pieces] == [ToolPiece]
    assert pieces[0].arguments_text is None and pieces[0].call.arguments == {"city": "Paris"}


def test_a_call_cut_by_the_cap_stays_a_call_with_what_its_arguments_hold() -> None:
    cut = CALL[:CALL.index("return") + 6]
    pieces = fed(ToolCallStream(FALLBACK), cut, [5, 30, 60])
    assert isinstance(pieces[-1], ToolPiece) and not pieces[-1].complete  # no call to run
    assert pieces[-1].call.arguments == {"file_path": "/project/src/app.py", "content": "def f(x):\n    return"}
    assert pieces[-1].arguments_text == "".join(p.text for p in pieces if isinstance(p, ToolArgumentsPiece))


def test_a_malformed_call_ends_as_the_client_saw_it_begin() -> None:
    stream = ToolCallStream(FALLBACK)
    pieces = fed(stream, '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', [])
    assert [type(p) for p in pieces] == [ToolStartPiece, ToolArgumentsPiece, ToolPiece]  # it began: a block
    assert not pieces[-1].complete and pieces[-1].call.arguments == {} and stream.calls == []
    pieces = fed(ToolCallStream(FALLBACK), '<tool_call>{"name": get_weather}</tool_call>', [])
    assert [type(p) for p in pieces] == [BadToolPiece]  # it never began: text, so nothing is lost


def test_a_format_without_a_json_body_gives_the_call_at_its_end() -> None:
    def parse(text: str, tools=None) -> dict:
        name, _, argument = text.partition("(")
        return {"name": name, "arguments": {"x": argument.rstrip(")")}}

    pieces = fed(ToolCallStream(ToolFormat("[CALL]", "[/CALL]", parse)), "[CALL]f(1)[/CALL]", [2, 9, 12])
    assert [type(p) for p in pieces] == [ToolPiece] and pieces[0].call.arguments == {"x": "1"}


def test_the_scanner_refuses_what_is_not_a_call_object() -> None:
    for text in ('["a"]', '{"name": 1, "arguments": {}}', '{"type": "function", "name": "f", "arguments": {}}'):
        scanner = JsonCallScanner()
        assert scanner.feed(text) == "" and scanner.refused


def test_partial_arguments_read_as_the_sdks_read_them() -> None:
    assert partial_arguments('{"a": "b", "c": "d') == {"a": "b", "c": "d"}
    assert partial_arguments('{"a": [1, 2') == {"a": [1, 2]}
    assert partial_arguments("") == {} and partial_arguments("[1]") == {}


def test_a_harmony_channel_call_streams_as_its_channel_does() -> None:
    assembler = OutputAssembler(None, "call_")
    chunks = ['{"city"', ': "Pa', 'ris"}']
    pieces = []
    for chunk in chunks:
        pieces += assembler.feed(TokenEvent("r", 0, "", calls=(CallText(0, "get_weather", chunk),)))
    pieces += assembler.finish()
    assert [type(p) for p in pieces] == [ToolStartPiece] + [ToolArgumentsPiece] * 3 + [ToolPiece]
    assert pieces[-1].call.arguments == {"city": "Paris"} and pieces[-1].arguments_text == "".join(chunks)
    assert assembler.calls == [pieces[-1].call] and pieces[-1].call.id == pieces[0].id


# -- the three APIs through the official SDKs ---------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = ScriptedEngine(script=lambda request: "I will write it." + CALL)
    with LiveServer(build_app(make_service(tmp_path_factory.mktemp("arguments"), engine))) as live:
        yield live


def test_anthropic_input_json_events_join_to_the_final_input(server) -> None:
    with anthropic.Anthropic(base_url=server.url, api_key="sk-local", max_retries=0) as client:
        with client.messages.stream(model="claude-opus-5-5", max_tokens=4000, tools=[WRITE_TOOL_ANTHROPIC],
                                    messages=[{"role": "user", "content": "Write app.py"}]) as stream:
            parts = [event.partial_json for event in stream if event.type == "input_json"]
            final = stream.get_final_message()
    assert len(parts) > 50  # as written (a character a token here), not in a few pieces at the end
    assert "".join(parts) == ARGUMENTS_TEXT
    tool = final.content[1]
    assert tool.type == "tool_use" and tool.name == "Write" and tool.input == ARGUMENTS == json.loads("".join(parts))
    assert final.stop_reason == "tool_use"


def test_openai_chat_argument_deltas_join_to_the_call(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with client.chat.completions.stream(model="local", tools=[WRITE_TOOL_OPENAI],
                                        messages=[{"role": "user", "content": "Write app.py"}]) as stream:
        deltas = [event.arguments_delta for event in stream if event.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert len(deltas) > 50 and "".join(deltas) == call.function.arguments == ARGUMENTS_TEXT
    assert call.function.name == "Write" and json.loads(call.function.arguments) == ARGUMENTS
    assert final.choices[0].finish_reason == "tool_calls"


def test_responses_function_call_argument_deltas_join_to_the_item(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "name": "Write", "parameters": WRITE_TOOL_ANTHROPIC["input_schema"]}
    with client.responses.stream(model="local", input="Write app.py", tools=[tool]) as stream:
        deltas, done = [], []
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                deltas.append(event.delta)
            elif event.type == "response.function_call_arguments.done":
                done.append(event.arguments)
        final = stream.get_final_response()
    item = next(item for item in final.output if item.type == "function_call")
    assert len(deltas) > 50 and "".join(deltas) == done[0] == item.arguments == ARGUMENTS_TEXT
    assert item.name == "Write" and json.loads(item.arguments) == ARGUMENTS and item.status == "completed"


# -- Qwen3-Coder's XML calls (Qwen3.5, Qwen3-Next) -----------------------------------------------------
XML_TOOLS = [{"type": "function", "function": {"name": "Write", "parameters": {"type": "object", "properties": {
    "file_path": {"type": "string"}, "content": {"type": "string"}, "line": {"type": "integer"},
    "replace_all": {"type": "boolean"}, "options": {"type": "object"}, "note": {"type": "string"}}}}}]
XML_BODY = ("\n<function=Write>\n<parameter=file_path>\n/project/app.py\n</parameter>\n"
            "<parameter=content>\n\ndef f():\n    return '</param' + \"x\"  # not the end\n\n</parameter>\n"
            "<parameter=line>\n42\n</parameter>\n<parameter=replace_all>\nfalse\n</parameter>\n"
            '<parameter=options>\n{"a": [1, {"b": null}]}\n</parameter>\n<parameter=note>\nNULL\n</parameter>\n'
            "<parameter=undescribed>\nnull-ish\n</parameter>\n</function>\n")
XML_CALL = "<tool_call>" + XML_BODY + "</tool_call>"


def _xml_format() -> ToolFormat:
    from mlx_lm.tool_parsers import qwen3_coder

    return ToolFormat(qwen3_coder.tool_call_start, qwen3_coder.tool_call_end, qwen3_coder.parse_tool_call,
                      streams="qwen3_xml")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(XML_CALL)), max_size=60))
def test_a_qwen3_xml_call_streams_the_json_its_parser_makes_however_the_tokens_cut_it(cuts: list[int]) -> None:
    from mlx_lm.tool_parsers import qwen3_coder

    expected = qwen3_coder.parse_tool_call(XML_BODY, XML_TOOLS)["arguments"]
    assert expected["note"] is None and expected["line"] == 42 and "\n\ndef f()" not in expected["content"]
    pieces = fed(ToolCallStream(_xml_format(), XML_TOOLS), XML_CALL, cuts)
    assert isinstance(pieces[0], ToolStartPiece) and pieces[0].name == "Write"
    streamed = "".join(p.text for p in pieces if isinstance(p, ToolArgumentsPiece))
    assert json.loads(streamed) == expected == pieces[-1].call.arguments
    assert pieces[-1].complete and pieces[-1].arguments_text == streamed


def test_a_qwen3_xml_string_parameter_streams_while_it_is_written() -> None:
    stream = ToolCallStream(_xml_format(), XML_TOOLS)
    head = XML_CALL[:XML_CALL.index("return")]
    streamed = "".join(p.text for p in stream.feed(head) if isinstance(p, ToolArgumentsPiece))
    assert streamed == '{"file_path": "/project/app.py", "content": "\\ndef f():\\n    '


def test_the_tool_format_of_a_qwen3_xml_tokenizer_streams() -> None:
    from mlx_lm.tool_parsers import json_tools, qwen3_coder

    from engine.formats.tools.calls import tool_format_for

    class Tokenizer:
        has_tool_calling = True
        tool_call_start, tool_call_end = "<tool_call>", "</tool_call>"

        def __init__(self, parser) -> None:
            self.tool_parser = parser

    assert tool_format_for(Tokenizer(qwen3_coder.parse_tool_call)).streams == "qwen3_xml"
    assert tool_format_for(Tokenizer(json_tools.parse_tool_call)).streams == "json"
    assert FALLBACK.streams == "json"
