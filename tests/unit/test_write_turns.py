"""The recorded Claude Code write turns bench_speculation replays: the recorder's script, the committed trace,
and one turn sent to a live server as each protocol carries it, timed and counted from the server's own usage."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine.api.app import create_app
from tests.support.router_app import LiveServer, make_service
from tests.support.scripted_engine import ScriptedEngine
from bench.chat_stream import Turn
from bench.trace_format import Recorded
from bench.record_claude_code import scripted_write_turn, write_turn_file, write_turn_prompt
from bench.write_turns import agent_row, send_write_turn, write_turns

BENCH = Path(__file__).resolve().parents[2] / "bench"


pytestmark = pytest.mark.unit

TOOLS = [{"name": "Read"}, {"name": "Write"}, {"name": "Edit"}]


def test_a_source_is_cut_at_a_line_end_and_its_first_definition_is_the_one_renamed(tmp_path: Path) -> None:
    source = tmp_path / "shop.py"
    source.write_text('"""Doc."""\n\nLIMIT = 3\n\n\nclass Basket:\n    pass\n\n\ndef total(b):\n    return 0\n')
    text, old = write_turn_file(source, max_chars=40)
    assert text == '"""Doc."""\n\nLIMIT = 3\n\n\nclass Basket:\n' and old == "Basket"
    assert write_turn_prompt("shop.py", old) == "In shop.py, rename `Basket` to `Basket_renamed` everywhere, and write the whole file back."
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(SystemExit, match="no top-level def or class"):
        write_turn_file(tmp_path / "empty.py", max_chars=4000)


def test_the_script_reads_the_file_then_writes_it_back_renamed_then_answers(tmp_path: Path) -> None:
    target = tmp_path / "shop.py"
    target.write_text("class Basket:\n    pass\n\n\nBaskets = [Basket()]  # Basket\n")
    first = {"tools": TOOLS, "messages": [{"role": "user", "content": "rename it"}]}
    read = scripted_write_turn(first, target, "Basket")
    assert read == {"id": "toolu_recorder_read", "name": "Read", "input": {"file_path": str(target)}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": read["id"], "content": "1\tclass"}]}
    second = {"tools": TOOLS, "messages": [*first["messages"], {"role": "assistant", "content": [read]}, result]}
    write = scripted_write_turn(second, target, "Basket")
    assert write["name"] == "Write" and write["input"]["file_path"] == str(target)
    # Whole words only: `Baskets` is another name.
    assert write["input"]["content"] == "class Basket_renamed:\n    pass\n\n\nBaskets = [Basket_renamed()]  # Basket_renamed\n"
    third = {"tools": TOOLS, "messages": [*second["messages"], {"role": "assistant", "content": [write]}, result]}
    assert scripted_write_turn(third, target, "Basket") is None
    assert scripted_write_turn({"messages": first["messages"]}, target, "Basket") is None  # a side request


def test_the_committed_trace_holds_eight_sessions_each_with_its_file_as_the_cli_read_it() -> None:
    turns = write_turns()
    assert len(turns) == 8 and len({t.session for t in turns}) == 8
    for turn in turns:
        asked = turn.body["messages"][0]["content"]
        ask = asked if isinstance(asked, str) else " ".join(b.get("text", "") for b in asked)
        assert "_renamed` everywhere, and write the whole file back." in ask
        results = [b for m in turn.body["messages"] if isinstance(m["content"], list) for b in m["content"]
                   if b.get("type") == "tool_result"]
        assert len(results) == 1
        # The CLI's Read gives the file with line numbers; the name to rename is in it.
        content = json.dumps(results[0]["content"])
        old = ask.split("rename `", 1)[1].split("`", 1)[0]
        assert "1\\t" in content and old in content
        assert {"Read", "Write", "Edit"} <= {t["name"] for t in turn.body["tools"]}


@pytest.mark.parametrize("protocol", ["anthropic", "openai"])
def test_a_write_turn_is_sent_as_its_protocol_carries_it_and_counted_from_the_servers_usage(
        tmp_path: Path, protocol: str) -> None:
    # The recorded turns' shape, small enough for the scripted model's context (one token per character).
    recorded = write_turns()[0]
    read = {"type": "tool_use", "id": "toolu_recorder_read", "name": "Read", "input": {"file_path": "/p/drafting.py"}}
    body = {**recorded.body, "system": "You edit code.", "tools": [
        {"name": name, "description": name, "input_schema": {"type": "object", "properties": {}}}
        for name in ("Read", "Write")], "messages": [
        {"role": "user", "content": "In drafting.py, rename `Drafter` everywhere."},
        {"role": "assistant", "content": [read]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": read["id"], "content": "1\tclass Drafter:"}]}]}
    request = Recorded(recorded.line, None, None, recorded.path, recorded.headers, body, recorded.session)
    engine = ScriptedEngine(lambda r: "class Drafter_renamed:")

    async def send(url: str) -> tuple[Turn, dict]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            turn = await send_write_turn(http, request, protocol, "write-0-r0", max_tokens=64)
            row = await agent_row(http, "write-0-r0") if protocol == "anthropic" else {}
            return turn, row

    with LiveServer(create_app(make_service(tmp_path / "cache", engine))) as server:
        turn, row = asyncio.run(send(server.url))
    sent = engine.requests[0]
    assert sent.max_tokens == 64 and sent.sampling.temperature == 0
    assert turn.text == "class Drafter_renamed:" and turn.completion_tokens == len("class Drafter_renamed:")
    assert turn.prompt_tokens == len(sent.prompt_tokens)
    assert turn.sent_at <= turn.first_token_at <= turn.done_at
    if protocol == "anthropic":
        # The session id given replaces the recorded one: the server's agent is named after it.
        assert row["agent_id"].startswith("cc-write-0-r0-") and row["last_ttft_s"] is not None


def test_the_workloads_flag_names_what_it_refuses() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.bench_speculation", "--workloads", "copy,edits"],
                          capture_output=True, text=True, timeout=120, cwd=BENCH.parent)
    assert done.returncode == 2 and "--workloads: unknown edits" in done.stderr


def test_turns_sent_one_after_another_are_timed_by_their_own_decode_times() -> None:
    from bench.bench_speculation import decode_tok_s

    def turn(first: float, done: float, tokens: int) -> Turn:
        return Turn("a", 0, "", 0.0, first, done, 1, tokens, None, 0)

    turns = [turn(10.0, 12.0, 20), turn(40.0, 42.0, 20)]  # 26 s of the second's prefill between them
    assert decode_tok_s(turns, one_after_another=True) == pytest.approx(10.0)
    assert decode_tok_s(turns) == pytest.approx(40 / 32)


def test_a_tool_call_answer_is_compared_by_its_name_and_arguments(tmp_path: Path) -> None:
    recorded = write_turns()[0]
    body = {**recorded.body, "system": "You edit code.", "messages": [{"role": "user", "content": "Write it."}],
            "tools": [{"name": "Write", "description": "Write a file",
                       "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]}
    request = Recorded(recorded.line, None, None, recorded.path, recorded.headers, body, recorded.session)
    call = '<tool_call>\n{"name": "Write", "arguments": {"file_path": "/p/a.py"}}\n</tool_call>'
    engine = ScriptedEngine(lambda r: call)

    async def send(url: str) -> Turn:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await send_write_turn(http, request, "anthropic", "write-1-r0", max_tokens=200)

    with LiveServer(create_app(make_service(tmp_path / "cache", engine))) as server:
        turn = asyncio.run(send(server.url))
    assert turn.text == 'Write{"file_path": "/p/a.py"}' and turn.completion_tokens == len(call)
