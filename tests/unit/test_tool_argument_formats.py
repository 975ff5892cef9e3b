"""Tool arguments stream as written in GLM's, LongCat's, MiniMax-M2's, Gemma 4's, Mistral's, Kimi K2's and K3's,
LFM2's pythonic, FunctionGemma's, MiniCPM5's and Muse Spark's call formats: each scanner against mlx-lm's own
parser however the tokens cut the text, and the Anthropic and OpenAI streams through the official SDKs'
helpers on a scripted model (one character a token) whose tokenizer has that format's parser."""

from __future__ import annotations

import dataclasses
import json
import re

import anthropic
import openai
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.tool_parsers import (function_gemma, gemma4, glm47, kimi_k2, kimi_k3, laguna, longcat, minicpm5, minimax_m2,
                                 mistral, muse_spark, pythonic)

from engine.formats.tools.headed import HeadedJsonScanner, kimi_header, mistral_header
from engine.formats.tools.calls import (TextPiece, ToolArgumentsPiece, ToolCallStream, ToolFormat, ToolPiece,
                                   ToolStartPiece, tool_format_for)
from tests.support.byte_tokenizer import ByteTokenizer
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded

pytestmark = pytest.mark.unit

CONTENT = 'def f(x):\n    return {"a": [x, "}"]}  # </arg_value and </param are not the end\n\tpath = "C:\\\\tmp"'
ARGUMENTS = {"file_path": "/project/src/app.py", "content": CONTENT, "mode": {"append": False, "lines": [1, 2]}}
TOOLS = [{"type": "function", "function": {"name": "Write", "parameters": {"type": "object", "properties": {
    "file_path": {"type": "string"}, "content": {"type": "string"}, "line": {"type": "integer"},
    "mode": {"type": "object"}}}}}]

# GLM: strings as written (stripped), anything else read as JSON, a Python literal, or the text.
GLM_BODY = ("Write\n<arg_key>file_path</arg_key>\n<arg_value>/project/src/app.py</arg_value>\n"
            f"<arg_key>content</arg_key>\n<arg_value>\n{CONTENT}\n  \n</arg_value>\n"
            "<arg_key>line</arg_key>\\n<arg_value> 42 </arg_value>\n"
            '<arg_key>mode</arg_key>\n<arg_value>{"append": false, "lines": [1, 2]}</arg_value>\n'
            "<arg_key>undescribed</arg_key>\n<arg_value>None</arg_value>"
            "<arg_key>plain</arg_key><arg_value>some words</arg_value>\n")
# MiniMax: values stripped and converted by the schema's types; one it does not describe is a string, "null" None.
MINIMAX_BODY = ('\n<invoke name="Write">\n<parameter name="file_path">/project/src/app.py</parameter>\n'
                f'<parameter name="content">\n{CONTENT}\n  </parameter>\n<parameter name="line"> 42 </parameter>\n'
                '<parameter name="mode">{"append": false, "lines": [1, 2]}</parameter>\n'
                '<parameter name="undescribed">null</parameter><parameter name="plain">some words</parameter>\n'
                '</invoke>\n')
# Gemma 4: bare keys (quoted only right after "{" or ","), <|"|> around strings.
GEMMA4_BODY = ('call:Write{file_path:<|"|>/project/src/app.py<|"|>,content:<|"|>' + CONTENT
               + '<|"|>,mode:{append:false,lines:[1,2]},note:<|"|>a: b, c:<|"|>}')
LONGCAT_BODY = GLM_BODY.replace("arg_key>", "longcat_arg_key>").replace("arg_value>", "longcat_arg_value>")
MISTRAL_BODY = "Write[ARGS]" + json.dumps(ARGUMENTS, indent=1)
KIMI_BODY = ("<|tool_call_begin|>functions.Write:0<|tool_call_argument_begin|>" + json.dumps(ARGUMENTS)
             + "<|tool_call_end|>")
# LFM2: a Python list of calls, keyword arguments as Python literals (JSON's true/false/null read as Python's).
PYTHONIC_BODY = (f'[Write(file_path="/project/src/app.py", content={CONTENT!r}, line=42,\n'
                 ' mode={"append": false, "lines": [1, 2]}, note="joined " \'across\' "literals")]')
# FunctionGemma: <escape> around strings, other values to the next "," read as JSON or kept; no "}" anywhere
# in the arguments (the parser's end), so its content has none.
GEMMA_CONTENT = 'def f(x):\n    return [x, "a: b"]  # <escape is not the end\n\tpath = "C:\\\\tmp"'
FUNCTION_GEMMA_BODY = (f"call:Write{{file_path:<escape>/project/src/app.py<escape>,content:<escape>{GEMMA_CONTENT}"
                       "<escape>,line:42,plain:some words,flag:true}")
# MiniCPM5: <param> tags, a value with "<" or a newline in CDATA (as written), others stripped and typed by the
# tool's schema, as MiniMax's are.
MINICPM5_BODY = ('"Write"><param name="file_path">/project/src/app.py</param>\n'
                 f'<param name="content"><![CDATA[{CONTENT}]]></param><param name="line"> 42 </param>\n'
                 '<param name="mode">{"append": false, "lines": [1, 2]}</param>'
                 '<param name="undescribed">null</param><param name="plain"> some words </param>\n')
# Kimi K3: XTML tags in a tools section; a string argument as written, any other type read as JSON.
KIMI_K3_BODY = ('\n<|open|>call tool="Write" index="1"<|sep|>\n'
                '<|open|>argument key="file_path" type="string"<|sep|>/project/src/app.py<|close|>argument<|sep|>\n'
                f'<|open|>argument key="content"<|sep|>{CONTENT}<|close|>argument<|sep|>\n'
                '<|open|>argument key="mode" type="object"<|sep|>{"append": false, "lines": [1, 2]}'
                '<|close|>argument<|sep|>\n<|close|>call<|sep|>\n')
# Muse Spark: <atem:parameter> tags, a value read as JSON or else kept stripped.
MUSE_SPARK_BODY = ('\n<atem:invoke name="Write">\n<atem:parameter name="file_path">/project/src/app.py</atem:parameter>\n'
                   f'<atem:parameter name="content">{CONTENT}\n</atem:parameter>\n'
                   '<atem:parameter name="line"> 42 </atem:parameter>\n'
                   '<atem:parameter name="mode">{"append": false, "lines": [1, 2]}</atem:parameter>\n'
                   '<atem:parameter name="plain"> some words </atem:parameter>\n</atem:invoke>\n')


def parser_format(parser, streams: str) -> ToolFormat:
    return ToolFormat(parser.tool_call_start, parser.tool_call_end, parser.parse_tool_call, streams=streams)


FORMATS = {
    "glm47": (ToolFormat(glm47.tool_call_start, glm47.tool_call_end, glm47.parse_tool_call, streams="glm47"),
              GLM_BODY),
    "minimax_m2": (ToolFormat(minimax_m2.tool_call_start, minimax_m2.tool_call_end, minimax_m2.parse_tool_call,
                              streams="minimax_m2"), MINIMAX_BODY),
    "longcat": (ToolFormat(longcat.tool_call_start, longcat.tool_call_end, longcat.parse_tool_call, streams="longcat"),
                LONGCAT_BODY),
    "gemma4": (ToolFormat(gemma4.tool_call_start, gemma4.tool_call_end, gemma4.parse_tool_call, streams="gemma4"),
               GEMMA4_BODY),
    "mistral": (ToolFormat(mistral.tool_call_start, "", mistral.parse_tool_call, streams="mistral"), MISTRAL_BODY),
    "kimi": (ToolFormat(kimi_k2.tool_call_start, kimi_k2.tool_call_end, kimi_k2.parse_tool_call, streams="kimi"),
             KIMI_BODY),
    "pythonic": (parser_format(pythonic, "pythonic"), PYTHONIC_BODY),
    "function_gemma": (parser_format(function_gemma, "function_gemma"), FUNCTION_GEMMA_BODY),
    "minicpm5": (parser_format(minicpm5, "minicpm5"), MINICPM5_BODY),
    "kimi_k3": (parser_format(kimi_k3, "kimi_k3"), KIMI_K3_BODY),
    "muse_spark": (parser_format(muse_spark, "muse_spark"), MUSE_SPARK_BODY),
}
# The formats whose parsers strip a value, so whitespace after its last word waits for the next one.
STRIPPED = ("glm47", "longcat", "minimax_m2", "muse_spark")


def call_text(kind: str) -> str:
    fmt, body = FORMATS[kind]
    return fmt.start + body + fmt.end


def parsed_arguments(kind: str) -> dict:
    fmt, body = FORMATS[kind]
    parsed = fmt.parse(body, TOOLS)
    return (parsed[0] if isinstance(parsed, list) else parsed)["arguments"]


def fed(stream: ToolCallStream, text: str, cuts: list[int]) -> list:
    pieces, at = [], 0
    for cut in sorted(set(c for c in cuts if c <= len(text))) + [len(text)]:
        pieces += stream.feed(text[at:cut])
        at = cut
    return pieces + stream.finish()


def test_the_parsers_read_what_the_tests_expect() -> None:
    for kind in ("glm47", "longcat", "minimax_m2"):
        tagged = parsed_arguments(kind)
        assert tagged["content"] == CONTENT and tagged["line"] == 42 and tagged["mode"] == ARGUMENTS["mode"]
        assert tagged["undescribed"] is None and tagged["plain"] == "some words"
    assert parsed_arguments("mistral") == parsed_arguments("kimi") == ARGUMENTS
    assert parsed_arguments("gemma4") == {**ARGUMENTS, "note": "a: b, c:"}
    assert parsed_arguments("pythonic") == {**ARGUMENTS, "line": 42, "note": "joined acrossliterals"}
    assert parsed_arguments("function_gemma") == {"file_path": "/project/src/app.py", "content": GEMMA_CONTENT,
                                                  "line": 42, "plain": "some words", "flag": True}
    assert parsed_arguments("minicpm5") == {**ARGUMENTS, "line": 42, "undescribed": None, "plain": "some words"}
    assert parsed_arguments("kimi_k3") == ARGUMENTS
    assert parsed_arguments("muse_spark") == {**ARGUMENTS, "line": 42, "plain": "some words"}


@pytest.mark.parametrize("kind", sorted(FORMATS))
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=60))
def test_a_call_streams_the_json_its_parser_makes_however_the_tokens_cut_it(kind: str, cuts: list[int]) -> None:
    text = "Writing it." + call_text(kind)
    pieces = fed(ToolCallStream(FORMATS[kind][0], TOOLS), text, cuts)
    kinds = [type(p) for p in pieces]
    start = kinds.index(ToolStartPiece)
    assert "".join(p.text for p in pieces[:start] if isinstance(p, TextPiece)) == "Writing it."
    assert pieces[start].name == "Write" and kinds[-1] is ToolPiece
    assert set(kinds[start + 1:-1]) == {ToolArgumentsPiece}
    streamed = "".join(p.text for p in pieces if isinstance(p, ToolArgumentsPiece))
    assert json.loads(streamed) == parsed_arguments(kind) == pieces[-1].call.arguments
    assert pieces[-1].complete and pieces[-1].arguments_text == streamed


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_a_call_written_a_character_at_a_time_streams_to_the_same_json(kind: str) -> None:
    """The finest cut (a tag's \\b or a literal's quote still being written at every step) never refuses a call."""
    text = call_text(kind)
    pieces = fed(ToolCallStream(FORMATS[kind][0], TOOLS), text, list(range(len(text))))
    streamed = [p.text for p in pieces if isinstance(p, ToolArgumentsPiece)]
    assert len(streamed) > 30 and json.loads("".join(streamed)) == parsed_arguments(kind)
    assert pieces[-1].complete


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_a_string_argument_streams_while_it_is_written(kind: str) -> None:
    text = call_text(kind)
    head = text[:text.index("return")]
    stream = ToolCallStream(FORMATS[kind][0], TOOLS)
    streamed = "".join(p.text for p in stream.feed(head) if isinstance(p, ToolArgumentsPiece))
    tail = 'def f(x):' if kind in STRIPPED else 'def f(x):\\n    '
    assert re.search(r'"content": ?"' + re.escape(tail) + "$", streamed), streamed


def test_a_glm_value_held_back_is_only_what_the_parser_would_strip() -> None:
    stream = ToolCallStream(FORMATS["glm47"][0], TOOLS)
    pieces = stream.feed("<tool_call>Write<arg_key>content</arg_key><arg_value>  two words  \n")
    assert "".join(p.text for p in pieces if isinstance(p, ToolArgumentsPiece)) == '{"content": "two words'
    pieces = stream.feed("and more</arg_value></tool_call>")
    assert "".join(p.text for p in pieces if isinstance(p, ToolArgumentsPiece)) == '  \\nand more"}'
    assert pieces[-1].call.arguments == {"content": "two words  \nand more"}


@pytest.mark.parametrize("kind, body", [
    ("mistral", '[{"name": "Write", "arguments": {"file_path": "a"}}]'),  # the JSON list form
    ("mistral", "Write[ARGS][1, 2]"),  # arguments that are not an object
    ("kimi", "<|tool_call_begin|>Write<|tool_call_argument_begin|>{}<|tool_call_end|>"),  # an id without :N
    ("glm47", '{"name": "Write", "arguments": {"file_path": "a"}}'),  # GLM's JSON fallback
    ("minimax_m2", '<function name="Write"></function>'),  # no invoke: text, as the parser refuses it
    ("gemma4", 'Write{file_path:<|"|>a<|"|>}'),  # no call: before the name
    ("pythonic", 'Write(file_path="a")'),  # no list around the call: the parser's regex finds none
    ("pythonic", '[Write("a", content="b")]'),  # a positional argument: the parser's regex reads it
    ("pythonic", '[Write(**extra, file_path="a")]'),  # **kwargs first
    ("function_gemma", "Write{file_path:a}"),  # no call: before the name
    ("function_gemma", "call:Write{just text}"),  # no key
    ("kimi_k3", '<|open|>call index="1"<|sep|><|close|>call<|sep|>'),  # no tool name: the parser skips it
    ("muse_spark", '<atem:invoke tool="Write"><atem:parameter name="a">1</atem:parameter></atem:invoke>'),
])
def test_a_body_in_another_shape_comes_whole_when_the_call_ends(kind: str, body: str) -> None:
    """As the call came before it streamed: the same pieces as the format without a scanner gives."""
    fmt = FORMATS[kind][0]
    text = fmt.start + body + fmt.end
    pieces = fed(ToolCallStream(fmt, TOOLS), text, [3, 9, 17])
    whole = fed(ToolCallStream(dataclasses.replace(fmt, streams=None), TOOLS), text, [])
    assert not any(isinstance(p, (ToolStartPiece, ToolArgumentsPiece)) for p in pieces)
    assert [type(p) for p in pieces] == [type(p) for p in whole]
    if isinstance(whole[-1], ToolPiece):
        assert pieces[-1].call.arguments == whole[-1].call.arguments and pieces[-1].call.name == whole[-1].call.name


def test_the_headers_say_when_they_are_whole() -> None:
    assert mistral_header("Wri") is None and mistral_header("Write[AR") is None
    assert mistral_header(" Write [ARGS]{") == ("Write", len(" Write [ARGS]"))
    assert kimi_header("<|tool_call_be") is None and kimi_header("<|tool_call_begin|>functions.Wr") is None
    assert kimi_header("functions.Write:3<|tool_call_argument_begin|>")[0] == "Write"
    for bad in ("Write x[ARGS]", "{"):
        scanner = HeadedJsonScanner(mistral_header)
        assert scanner.feed(bad) == "" and scanner.refused


def test_a_minimax_value_that_may_be_null_waits_and_one_that_is_not_streams() -> None:
    stream = ToolCallStream(FORMATS["minimax_m2"][0], TOOLS)
    head = '<minimax:tool_call><invoke name="Write"><parameter name="plain"> nu'
    assert "".join(p.text for p in stream.feed(head) if isinstance(p, ToolArgumentsPiece)) == "{"
    pieces = stream.feed('ll and more</parameter></invoke></minimax:tool_call>')
    assert pieces[-1].call.arguments == {"plain": "null and more"} and pieces[-1].complete


@pytest.mark.parametrize("kind, body", [
    ("kimi", KIMI_BODY + KIMI_BODY.replace("Write:0", "Write:1").replace("app.py", "test.py")),
    ("minimax_m2", MINIMAX_BODY + MINIMAX_BODY.replace("app.py", "test.py")),
    ("mistral", MISTRAL_BODY + MISTRAL_BODY.replace("app.py", "test.py")),
    ("gemma4", GEMMA4_BODY + GEMMA4_BODY.replace("app.py", "test.py")),
    ("pythonic", PYTHONIC_BODY[:-1] + ", " + PYTHONIC_BODY[1:].replace("app.py", "test.py")),
    ("kimi_k3", KIMI_K3_BODY + KIMI_K3_BODY.replace("app.py", "test.py")),
    ("muse_spark", MUSE_SPARK_BODY + MUSE_SPARK_BODY.replace("app.py", "test.py")),
])
def test_every_call_of_a_section_is_kept_the_first_as_it_streamed(kind: str, body: str) -> None:
    fmt = FORMATS[kind][0]
    stream = ToolCallStream(fmt, TOOLS)
    pieces = fed(stream, fmt.start + body + fmt.end, [40, 90])
    calls = [p for p in pieces if isinstance(p, ToolPiece)]
    assert [c.call.arguments["file_path"] for c in calls] == ["/project/src/app.py", "/project/src/test.py"]
    assert calls[0].arguments_text is not None and calls[1].arguments_text is None  # streamed, then whole
    assert stream.calls == [c.call for c in calls] and calls[0].call.id != calls[1].call.id


def test_a_scanner_that_fails_leaves_the_call_to_its_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.formats.tools.glm import GlmCallScanner

    def broken(self, text: str) -> str:
        raise KeyError("function")

    monkeypatch.setattr(GlmCallScanner, "feed", broken)
    pieces = fed(ToolCallStream(FORMATS["glm47"][0], TOOLS), call_text("glm47"), [10, 50])
    assert [type(p) for p in pieces] == [ToolPiece] and pieces[0].call.arguments == parsed_arguments("glm47")


def test_a_call_cut_by_the_cap_stays_a_call_with_what_it_holds() -> None:
    fmt = FORMATS["glm47"][0]
    text = call_text("glm47")
    pieces = fed(ToolCallStream(fmt, TOOLS), text[:text.index("return")], [])
    assert isinstance(pieces[-1], ToolPiece) and not pieces[-1].complete
    assert pieces[-1].call.arguments["file_path"] == "/project/src/app.py"


def test_the_tool_formats_of_these_tokenizers_stream() -> None:
    for parser, streams in ((glm47, "glm47"), (laguna, "glm47"), (longcat, "longcat"), (minimax_m2, "minimax_m2"),
                            (gemma4, "gemma4"), (mistral, "mistral"), (kimi_k2, "kimi"), (kimi_k3, "kimi_k3"),
                            (pythonic, "pythonic"), (function_gemma, "function_gemma"), (minicpm5, "minicpm5"),
                            (muse_spark, "muse_spark")):
        fmt = tool_format_for(ToolTokenizer(parser))
        assert fmt.streams == streams and fmt.start == parser.tool_call_start and fmt.end == parser.tool_call_end


# -- through the official SDKs' stream helpers -----------------------------------------------------------
class ToolTokenizer(ByteTokenizer):
    """The byte tokenizer with a tool parser, as mlx-lm's TokenizerWrapper has for a model whose template calls
    tools."""

    has_tool_calling = True

    def __init__(self, parser) -> None:
        super().__init__()
        self.tool_parser = parser.parse_tool_call
        self.tool_call_start, self.tool_call_end = parser.tool_call_start, parser.tool_call_end


PARSERS = {"glm47": glm47, "longcat": longcat, "minimax_m2": minimax_m2, "gemma4": gemma4, "mistral": mistral,
           "kimi": kimi_k2, "kimi_k3": kimi_k3, "pythonic": pythonic, "function_gemma": function_gemma,
           "minicpm5": minicpm5, "muse_spark": muse_spark}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def server(request, tmp_path_factory):
    kind = request.param
    engine = ScriptedEngine(script=lambda _: "I will write it." + call_text(kind),
                            loaded=scripted_loaded(tokenizer=ToolTokenizer(PARSERS[kind])))
    with LiveServer(build_app(make_service(tmp_path_factory.mktemp(f"formats-{kind}"), engine))) as live:
        yield kind, live


def test_anthropic_input_json_events_join_to_the_final_input(server) -> None:
    kind, live = server
    tool = {"name": "Write", "input_schema": TOOLS[0]["function"]["parameters"]}
    with anthropic.Anthropic(base_url=live.url, api_key="sk-local", max_retries=0) as client:
        with client.messages.stream(model="claude-opus-5-5", max_tokens=4000, tools=[tool],
                                    messages=[{"role": "user", "content": "Write app.py"}]) as stream:
            parts = [event.partial_json for event in stream if event.type == "input_json"]
            final = stream.get_final_message()
    assert len(parts) > 30  # as written (a character a token here), not in one piece at the end
    used = next(block for block in final.content if block.type == "tool_use")
    assert used.name == "Write" and used.input == json.loads("".join(parts)) == parsed_arguments(kind)
    assert final.stop_reason == "tool_use"


def test_openai_chat_argument_deltas_join_to_the_call(server) -> None:
    kind, live = server
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    with client.chat.completions.stream(model="local", tools=TOOLS,
                                        messages=[{"role": "user", "content": "Write app.py"}]) as stream:
        deltas = [event.arguments_delta for event in stream if event.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert len(deltas) > 30 and "".join(deltas) == call.function.arguments
    assert call.function.name == "Write" and json.loads(call.function.arguments) == parsed_arguments(kind)
    assert final.choices[0].finish_reason == "tool_calls"
