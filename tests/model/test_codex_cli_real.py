"""The real Codex CLI (npm ``@openai/codex``) against the real server on Gemma 3 270M, as a user runs it.

The provider goes into ``$CODEX_HOME/config.toml`` exactly as the README says (base URL, ``wire_api =
"responses"``, an env key), then ``codex exec "..."`` and ``codex exec resume --last "..."``. Codex sends
``store: false`` and its whole history every turn, with its thread id as ``prompt_cache_key``: the resumed
run must be served from the first run's cache. Codex's system prompt and tools render to ~6.3K tokens,
so the first run pays one long prefill (~27 s here); SmolLM2's 8K context would leave too little room,
hence Gemma 3 (32K).

Gemma 3 270M is a base model: a sampled answer to Codex's prompt is sometimes a short reply and
sometimes a rambling one that runs to the output cap (2026-12-01: the resumed run's sampled answer ran
1,024 tokens, 59 s). So this module's server answers greedily (``default_temperature``, for requests that
name none, as Codex's do) and caps replies at 128 tokens (``max_output_tokens``): settings of the server,
none of the client. A reply cut at the cap is a ``response.incomplete``, which Codex reports as
"Incomplete response returned" and exits 1: the protocol working as designed, and reported as such here,
not hidden. Measured on the 2-core CPU (2026-11-29): "What is 2+2? ..." answered in 16 tokens (4.6 s, from
the first session's shared prefix); the resumed run read 6,326 of 6,352 prompt tokens from its cache (2.7 s).

Every request Codex sent is recorded (``--record-requests``); with ``SEMANTIC_SAVE_TRACE=PATH`` the
trace is copied there (how ``bench/traces/codex_exec.jsonl`` was made) for ``bench/replay.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest
from fastapi import FastAPI

from engine.api.app import create_app
from engine.domain.requests import GenerationRequest
from tests.model.claude_code_cli import npm_prefix
from tests.model.codex_cli import Codex, install_codex
from tests.model.real_api import RealApi, running_api, wait_for
from tests.model.request_log import Exchange, RequestLog
from tests.support.router_app import LiveServer, make_service
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded

pytestmark = pytest.mark.solo(reason="the real Codex CLI, each run held to a time limit")

TASK = "What is 2+2? Answer with the number only."
FOLLOW_UP = "And 3+3?"
# The server's output cap for this module's sessions (a base model's answer runs on otherwise; see above).
MAX_OUTPUT_TOKENS = 128


@pytest.fixture(scope="module")
def exchanges() -> list[Exchange]:
    return []


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("codex-trace") / "trace.jsonl"


@pytest.fixture(scope="module")
def api(gemma3, gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory,
        exchanges: list[Exchange], trace_path: Path) -> Iterator[RealApi]:
    def record(app: FastAPI) -> None:
        app.add_middleware(RequestLog, exchanges=exchanges)

    with running_api(gemma3, tmp_path_factory.mktemp("codex-cache"), gemma3_path, configure=record,
                     record_requests=trace_path, default_temperature=0.0,
                     max_output_tokens=MAX_OUTPUT_TOKENS) as running:
        yield running


@pytest.fixture(scope="module")
def codex(api: RealApi, tmp_path_factory: pytest.TempPathFactory) -> Codex:
    root = tmp_path_factory.mktemp("codex-user")
    codex = Codex(install_codex(npm_prefix()), api.url, root / ".codex", root / "project", "gemma3-270m")
    codex.write_config()
    return codex


def turns(exchanges: list[Exchange]) -> list[Exchange]:
    return [e for e in exchanges if e.method == "POST" and e.path == "/v1/responses"]


def report(api: RealApi, exchanges: list[Exchange], *runs) -> str:
    lines = ["requests Codex sent:"] + [f"[{n}] {e.summary()}" for n, e in enumerate(exchanges)]
    lines += ["engine events:"] + api.event_lines()
    return "\n".join(lines + [run.describe() for run in runs])


def ended_as_the_server_said(run, exchange: Exchange) -> None:
    """Codex's exit matches the server's ending: completed -> status 0 with the answer printed;
    incomplete (the base model ran to the output cap) -> Codex names it and exits 1."""
    final = exchange.final_response()
    assert final is not None and final["status"] in ("completed", "incomplete"), final
    if final["status"] == "completed":
        assert run.returncode == 0 and run.stdout.strip()
    else:
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
        assert run.returncode == 1 and "Incomplete response returned, reason: max_output_tokens" in run.stderr


def test_codex_exec_then_resume_reuses_the_cache(codex: Codex, api: RealApi, exchanges: list[Exchange],
                                                 trace_path: Path) -> None:
    first = codex.exec(TASK)
    print("\n" + report(api, exchanges, first))
    (opening,) = turns(exchanges)
    body = opening.json()
    # What Codex 0.171 sends (platform.md): the server must take all of it as it is.
    assert body["store"] is False and body["stream"] is True and body["prompt_cache_key"]
    assert [i.get("role") for i in body["input"]][:2] == ["developer", "developer"]
    assert any(t["type"] == "web_search" for t in body["tools"]) and "client_metadata" in body
    assert opening.status == 200, report(api, exchanges, first)
    ended_as_the_server_said(first, opening)
    agent = wait_for(lambda: next((a for a in api.stats()["agents"] if a["source"] == "codex"), None), 30,
                     "the Codex session in the agents listing")
    assert agent["agent_id"] == f"codex-{body['prompt_cache_key']}"

    seen = len(exchanges)
    second = codex.exec("resume", "--last", FOLLOW_UP)
    print("\n" + report(api, exchanges[seen:], second))
    (resumed,) = turns(exchanges[seen:])
    assert resumed.json()["prompt_cache_key"] == body["prompt_cache_key"]
    ended_as_the_server_said(second, resumed)
    usage = resumed.usage()
    print(f"\nfirst run usage {opening.usage()}\nresumed run usage {usage}")
    assert usage is not None and usage["input_tokens_details"]["cached_tokens"] > 0.5 * usage["input_tokens"]

    lines = wait_for(lambda: _trace_lines(trace_path, 2), 10, "both requests in the trace")
    assert [line["body"] for line in lines] == [e.json() for e in turns(exchanges)]
    assert all("authorization" not in line["headers"] for line in lines)
    if os.environ.get("SEMANTIC_SAVE_TRACE"):
        shutil.copyfile(trace_path, os.environ["SEMANTIC_SAVE_TRACE"])


def _trace_lines(path: Path, count: int) -> list[dict] | None:
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sorted(lines, key=lambda line: line["t"]) if len(lines) >= count else None


def test_a_prompt_past_the_context_is_the_error_codex_reports(codex: Codex, api: RealApi,
                                                              exchanges: list[Exchange]) -> None:
    """Codex's prompt plus a ~36K-token task overflows Gemma's 32K context: the streamed turn fails with
    ``context_length_exceeded``, which Codex names as a full context window (not a retry, not a crash)."""
    task = "Summarise this list: " + " ".join(f"item{i}" for i in range(12_000))  # under Linux's 128 KiB per argument
    seen = len(exchanges)
    run = codex.exec(task, timeout_s=120)
    (turn,) = turns(exchanges[seen:])
    final = turn.final_response()
    print(f"\n{run.describe()[-600:]}\nfinal response: {final}")
    assert final is not None and final["status"] == "failed" and final["error"]["code"] == "context_length_exceeded"
    assert run.returncode == 1 and "ran out of room in the model's context window" in run.stderr


# -- Codex's own tools, with a scripted model that calls one -------------------------------------------
LS_CALL = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'
ANSWER = "The folder holds one file."


def test_codex_runs_a_tool_call_and_sends_its_output_back(tmp_path: Path) -> None:
    """Gemma 3 270M never calls a tool, so a scripted model does, in the Hermes format the server parses:
    the real Codex must take the ``function_call`` item, run ``exec_command``, and send a
    ``function_call_output`` for the same call id, which reaches the prompt; then it prints the answer."""
    engine = ScriptedEngine(loaded=scripted_loaded(context=65536, block_tokens=256))
    decode = engine.loaded.tokenizer.decode

    def script(request: GenerationRequest) -> str:
        return ANSWER if "<tool_response>" in decode(list(request.prompt_tokens)) else LS_CALL

    engine.script = script
    exchanges: list[Exchange] = []
    app = create_app(make_service(tmp_path / "cache", engine))
    app.add_middleware(RequestLog, exchanges=exchanges)
    with LiveServer(app) as server:
        codex = Codex(install_codex(npm_prefix()), server.url, tmp_path / ".codex", tmp_path / "project", "scripted")
        codex.write_config()
        (codex.project / "notes.txt").write_text("hello\n")
        run = codex.exec("List the files here.", timeout_s=180)
    sent = turns(exchanges)
    print("\n" + "\n".join(e.summary() for e in sent) + "\n" + run.describe()[-1500:])
    assert len(sent) == 2, run.describe()
    (call,) = [i for i in sent[0].final_response()["output"] if i["type"] == "function_call"]
    assert call["name"] == "exec_command" and json.loads(call["arguments"]) == {"cmd": "ls"}
    history = sent[1].json()["input"]
    echoed = [i for i in history if i.get("type") == "function_call"]
    outputs = [i for i in history if i.get("type") == "function_call_output"]
    assert [i["call_id"] for i in echoed] == [i["call_id"] for i in outputs] == [call["call_id"]]
    print(f"tool output Codex sent back: {outputs[0]['output']!r}")
    assert sent[1].json()["prompt_cache_key"] == sent[0].json()["prompt_cache_key"]
    assert sent[1].usage()["input_tokens_details"]["cached_tokens"] > 0.9 * sent[1].usage()["input_tokens"]
    assert run.returncode == 0 and ANSWER in run.stdout
