"""Recording what clients send (``--record-requests``) and replaying it (``bench/replay.py``):
secrets never reach the trace, sessions replay in order with their pauses, Anthropic bodies
translate for OpenAI-only servers, and a recorded trace replays against a live server."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from engine.api.app import create_app
from tests.support.router_app import LiveServer, make_service
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded
from bench.replay import main as replay_main
from bench.replay import detect_protocol, outgoing, replay, schedule
from bench.trace_format import TraceError, load_trace, to_openai

BENCH = Path(__file__).resolve().parents[2] / "bench"


pytestmark = pytest.mark.unit

KEY = "sk-recorded-secret-0123"
MESSAGES_BODY = {"model": "claude-sonnet-4", "max_tokens": 32000, "stream": True,
                 "system": [{"type": "text", "text": "You are terse."}],
                 "messages": [{"role": "user", "content": "Name one colour."}]}


def recorded_app(tmp_path: Path, trace: Path):
    return create_app(make_service(tmp_path / "cache", ScriptedEngine(lambda r: "Red."), api_key=KEY,
                                   record_requests=trace))


def post_messages(client: httpx.Client, session: str, body: dict) -> httpx.Response:
    headers = {"x-api-key": KEY, "x-claude-code-session-id": session, "anthropic-version": "2023-06-01"}
    return client.post("/v1/messages?beta=true", json=body, headers=headers)


def record_two_sessions(tmp_path: Path) -> Path:
    """A live server with the recorder on: session A sends two turns with a pause between, B one."""
    trace = tmp_path / "trace.jsonl"
    app = recorded_app(tmp_path, trace)
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert post_messages(client, "A", MESSAGES_BODY).status_code == 200
        time.sleep(0.3)
        follow = {**MESSAGES_BODY, "messages": MESSAGES_BODY["messages"] + [
            {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another."}]}
        assert post_messages(client, "A", follow).status_code == 200
        assert post_messages(client, "B", {**MESSAGES_BODY, "stream": False}).status_code == 200
        counted = client.post("/v1/messages/count_tokens", json={"model": "m", "messages": MESSAGES_BODY["messages"]},
                              headers={"x-api-key": KEY})
        assert counted.status_code == 200
        assert client.get("/v1/stats", headers={"x-api-key": KEY}).status_code == 200
        assert post_messages(client, "A", {"model": "m"}).status_code == 400  # refused ones are recorded too
    app.state.trace_writer.close()
    return trace


def test_the_recorder_writes_each_generation_request_without_secrets(tmp_path: Path) -> None:
    trace = record_two_sessions(tmp_path)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(r["path"], r["status"]) for r in lines] == [
        ("/v1/messages?beta=true", 200), ("/v1/messages?beta=true", 200), ("/v1/messages?beta=true", 200),
        ("/v1/messages?beta=true", 400)]
    assert KEY not in trace.read_text()
    assert all("x-api-key" not in r["headers"] and r["headers"]["x-claude-code-session-id"] in "AB" for r in lines)
    assert lines[0]["body"] == MESSAGES_BODY
    assert all(r["duration_s"] >= 0 for r in lines)
    # The second turn of A was sent after the first was answered and a pause of about 0.3 s.
    assert lines[1]["t"] - (lines[0]["t"] + lines[0]["duration_s"]) >= 0.25


def test_a_trace_groups_into_sessions_with_their_recorded_pauses(tmp_path: Path) -> None:
    requests = load_trace(record_two_sessions(tmp_path))
    assert len(requests) == 4
    plan = schedule(requests)
    (a_start, a_steps), (b_start, b_steps) = plan["s1"], plan["s2"]
    assert a_start == 0.0 and [s[0].session for s in a_steps] == ["A", "A", "A"]
    assert a_steps[1][1] >= 0.25  # the pause before A's second turn
    assert b_start > 0 and len(b_steps) == 1


def test_the_committed_claude_code_trace_loads_untimed() -> None:
    requests = load_trace(BENCH / "traces" / "claude_code_full.jsonl")
    assert requests and all(r.t is None and r.protocol == "anthropic" for r in requests)
    assert all(pause == 0.0 for _, steps in schedule(requests).values() for _, pause in steps)


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"path": "/v1/messages", "body": {"messages": []}}\nnot json\n')
    with pytest.raises(TraceError, match=":2: not JSON"):
        load_trace(trace)
    trace.write_text('{"path": "/v1/messages", "body": "text"}\n')
    with pytest.raises(TraceError, match="line 1: /v1/messages without a JSON object body"):
        load_trace(trace)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"method": "POST", "path": "/v1/messages/count_tokens", "body": {"messages": []}}\n')
    assert replay_main([str(empty), "--url", "http://127.0.0.1:9"]) == 2


def test_anthropic_bodies_translate_to_openai_chat() -> None:
    body = {
        "max_tokens": 500, "stream": True, "stop_sequences": ["END"],
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        "tools": [{"name": "Read", "description": "read a file", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Open a.txt"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Reading."},
                                              {"type": "tool_use", "id": "tu_1", "name": "Read",
                                               "input": {"path": "a.txt"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1",
                                          "content": [{"type": "text", "text": "hello"}]},
                                         {"type": "text", "text": "Summarise it."}]},
        ],
    }
    out = to_openai(body)
    assert out["messages"] == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Open a.txt"},
        {"role": "assistant", "content": "Reading.", "tool_calls": [
            {"id": "tu_1", "type": "function", "function": {"name": "Read", "arguments": '{"path": "a.txt"}'}}]},
        {"role": "tool", "tool_call_id": "tu_1", "content": "hello"},
        {"role": "user", "content": "Summarise it."},
    ]
    assert out["tools"][0]["function"] == {"name": "Read", "description": "read a file",
                                           "parameters": {"type": "object"}}
    assert out["stop"] == ["END"] and out["stream"] is True


def test_replayed_requests_are_capped_and_carry_the_replay_key(tmp_path: Path) -> None:
    request = load_trace(record_two_sessions(tmp_path))[0]
    path, headers, body = outgoing(request, "anthropic", 128, "k")
    assert path == "/v1/messages?beta=true" and headers["x-api-key"] == "k" and body["max_tokens"] == 128
    assert headers["x-claude-code-session-id"] == "A" and request.body["max_tokens"] == 32000
    path, headers, body = outgoing(request, "openai", 64, "k")
    assert path == "/v1/chat/completions" and body["max_tokens"] == 64
    assert body["stream_options"] == {"include_usage": True} and body["messages"][0]["role"] == "system"


@pytest.mark.parametrize("protocol", ["anthropic", "openai"])
def test_a_recorded_trace_replays_against_a_live_server(tmp_path: Path, protocol: str) -> None:
    requests = load_trace(record_two_sessions(tmp_path / "recorded"))
    engine = ScriptedEngine(lambda r: "Blue, then green.")
    with LiveServer(create_app(make_service(tmp_path / "cache", engine, api_key="replay"))) as server:
        started = time.perf_counter()
        turns = asyncio.run(replay(server.url, requests, protocol, max_tokens=8, verbose=False))
        elapsed = time.perf_counter() - started
    assert [(t.session, t.turn) for t in sorted(turns, key=lambda t: (t.session, t.turn))] == [
        ("s1", 0), ("s1", 1), ("s1", 2), ("s2", 0)]
    assert elapsed >= 0.25  # the recorded pause was kept
    ok = [t for t in turns if t.ok]
    refused = [t for t in turns if not t.ok]
    if protocol == "anthropic":
        # The refused request is refused again, with the server's own status.
        assert len(ok) == 3 and [t.status for t in refused] == [400]
    assert all(0 < t.ttft_s <= t.total_s and t.prompt_tokens > 0 and t.output_tokens == 8 for t in ok)
    assert all(r.max_tokens == 8 for r in engine.requests)
    if protocol == "anthropic":
        # Claude Code's session header names the agent: A's second turn reuses A's first.
        second = next(t for t in turns if (t.session, t.turn) == ("s1", 1))
        assert second.reused_tokens > 0


# -- Responses API traces (Codex CLI) ------------------------------------------------------------------
CODEX_TRACE = Path(__file__).parents[2] / "bench" / "traces" / "codex_exec.jsonl"


def test_the_committed_codex_trace_is_one_session_of_responses_turns() -> None:
    requests = load_trace(CODEX_TRACE)
    assert [r.protocol for r in requests] == ["responses"] * 2
    assert len({r.session for r in requests}) == 1 and requests[0].session == requests[0].body["prompt_cache_key"]
    assert detect_protocol(requests) == "responses"


def test_codex_bodies_translate_to_openai_chat() -> None:
    """What mlx_lm.server gets for a Codex turn: developer messages as system, calls as an assistant's
    tool calls, hosted tools and reasoning items left out, the output cap as max_tokens."""
    body = {"model": "m", "stream": True, "store": False, "instructions": "Be Codex.", "max_output_tokens": 99,
            "tools": [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
                      {"type": "web_search"}],
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]},
                      {"type": "reasoning", "summary": []},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
                      {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}]}
    chat = to_openai(body, "responses")
    assert chat["messages"] == [
        {"role": "system", "content": "Be Codex."}, {"role": "system", "content": "Rules."},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command"]
    assert chat["max_tokens"] == 99 and chat["stream"] is True


def test_responses_turns_replay_against_a_live_server(tmp_path: Path) -> None:
    """The Codex trace against semantic (its own protocol, capped output) and as chat completions."""
    requests = load_trace(CODEX_TRACE)
    path, headers, body = outgoing(requests[0], "responses", 8, "k")
    assert path == "/v1/responses" and body["max_output_tokens"] == 8 and headers["authorization"] == "Bearer k"
    assert outgoing(requests[0], "openai", 8, "k")[0] == "/v1/chat/completions"
    # Codex's prompt is ~40K bytes: one token a byte for the scripted model.
    engine = ScriptedEngine(lambda r: "4", loaded=scripted_loaded(context=65536, block_tokens=256))
    with LiveServer(create_app(make_service(tmp_path / "cache", engine))) as server:
        turns = asyncio.run(replay(server.url, requests, "responses", max_tokens=8, verbose=False, pause_scale=0.0))
    assert [t.ok for t in turns] == [True, True], [t.error for t in turns]
    assert all(t.prompt_tokens > 0 and t.output_tokens == 1 for t in turns)
    # Codex's thread id names the agent: the resumed turn reads the first from its cache.
    assert turns[1].reused_tokens > 0.5 * turns[1].prompt_tokens


def test_the_recorder_scripts_a_read_of_each_project_file_then_answers(tmp_path: Path) -> None:
    from bench.record_claude_code import PROJECT_FILES, scripted_tool_call

    tools = [{"name": "Bash"}, {"name": "Read"}]
    first = {"tools": tools, "messages": [{"role": "user", "content": "Read the files."}]}
    call = scripted_tool_call(first, tmp_path)
    names = sorted(PROJECT_FILES)
    assert call == {"id": "toolu_recorder_0", "name": "Read", "input": {"file_path": str(tmp_path / names[0])}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_recorder_0",
                                            "content": "..."}]}
    second = {"tools": tools, "messages": [*first["messages"], {"role": "assistant", "content": [call]}, result]}
    assert scripted_tool_call(second, tmp_path)["input"] == {"file_path": str(tmp_path / names[1])}
    both = {"tools": tools, "messages": [*second["messages"], result]}
    assert scripted_tool_call(both, tmp_path) is None  # every file read: the answer is text
    assert scripted_tool_call({"messages": first["messages"]}, tmp_path) is None  # a side request: no tools


def test_the_committed_tool_turns_trace_carries_the_clis_own_tool_results() -> None:
    from bench.record_claude_code import PROJECT_FILES

    requests = load_trace(BENCH / "traces" / "claude_code_tool_turns.jsonl")
    assert len(requests) == 3 and len({r.session for r in requests}) == 1
    results = [[block for message in r.body["messages"] if isinstance(message["content"], list)
                for block in message["content"] if block.get("type") == "tool_result"] for r in requests]
    assert [len(found) for found in results] == [0, 1, 2]
    # What the CLI's Read tool returned: the project's file, with its line numbers.
    assert "def needs_reorder" in json.dumps(results[1][0]["content"])
    assert "test_take_lowers_the_count" in json.dumps(results[2][1]["content"])
    assert all(name in json.dumps(requests[2].body) for name in PROJECT_FILES)
    translated = to_openai(requests[2].body)
    assert [m["role"] for m in translated["messages"]].count("tool") == 2
