"""The real Claude Code CLI (npm) against the real server on the real SmolLM2, as a user runs it.

Two print-mode runs in one project, exactly as typed: ``claude --bare -p
"Name one colour."``, then ``claude --bare --continue -p "Name another."``,
with only ANTHROPIC_BASE_URL and a key set: no output cap, no turn limit on
the client. The server's defaults (the model's sampling defaults, its output
cap, the repetition guard) must make each run finish in under 120 s on a
2-core CPU, and the continued conversation must be served from the first
run's KV cache (more than half of its prompt). Every request Claude Code
sent is recorded and printed: it is the evidence of what a real client does
against this server. The server's own recorder (``--record-requests``) keeps
the same requests as a trace for ``bench/replay.py``; with
``SEMANTIC_SAVE_TRACE=PATH`` the test copies it there (how
``bench/traces/claude_code_bare.jsonl`` was made).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from fastapi import FastAPI

from engine.api.identity import is_auxiliary
from tests.model.claude_code_cli import ClaudeCode, ClaudeRun, install_claude_code, npm_prefix, run_cli
from tests.model.real_api import RealApi, running_api, wait_for
from tests.model.request_log import Exchange, RequestLog
from tests.support.terminal import isolated_env, semantic_command

pytestmark = pytest.mark.solo(reason="the real Claude Code CLI, each run held to a time limit")


@pytest.fixture(scope="session")
def claude_binary() -> Path:
    return install_claude_code(npm_prefix())


@pytest.fixture(scope="module")
def exchanges() -> list[Exchange]:
    return []


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("claude-trace") / "trace.jsonl"


@pytest.fixture(scope="module")
def api(smollm2, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory,
        exchanges: list[Exchange], trace_path: Path) -> Iterator[RealApi]:
    def record(app: FastAPI) -> None:
        app.add_middleware(RequestLog, exchanges=exchanges)

    with running_api(smollm2, tmp_path_factory.mktemp("claude-cache"), smollm2_path, configure=record,
                     record_requests=trace_path) as running:
        yield running


@pytest.fixture
def claude(claude_binary: Path, api: RealApi, tmp_path: Path) -> ClaudeCode:
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    return ClaudeCode(claude_binary, api.url, home, project)


def main_turns(exchanges: list[Exchange]) -> list[Exchange]:
    """The conversation's own /v1/messages calls, without Claude Code's side requests (probes, titles)."""
    def is_main(e: Exchange) -> bool:
        body = e.json()
        return not is_auxiliary(body.get("max_tokens", 0), body.get("model"))

    return [e for e in exchanges if e.path == "/v1/messages" and e.session and is_main(e)]


def claude_code_agent_with_turns(api: RealApi, turns: int) -> dict | None:
    """The Claude Code agent with the most turns, once it has ``turns``; side requests are other agents."""
    agents = [a for a in api.stats()["agents"] if a["source"] == "claude-code"]
    busiest = max(agents, key=lambda a: a["turns"], default=None)
    return busiest if busiest is not None and busiest["turns"] >= turns else None


def report(api: RealApi, exchanges: list[Exchange], *runs: ClaudeRun) -> str:
    lines = ["requests Claude Code sent:"] + [f"[{n}] {e.summary()}" for n, e in enumerate(exchanges)]
    lines += ["engine events:"] + api.event_lines()
    lines += [run.describe() for run in runs]
    return "\n".join(lines)


RUN_LIMIT_S = 120.0


def test_claude_code_print_then_continue_reuses_the_cache(
    claude: ClaudeCode, api: RealApi, exchanges: list[Exchange],
) -> None:
    first = claude.print_mode("Name one colour.")
    print("\n" + report(api, exchanges, first))
    assert first.returncode == 0 and first.stdout.strip(), report(api, exchanges, first)
    assert first.seconds < RUN_LIMIT_S, report(api, exchanges, first)
    seen = len(exchanges)

    second = claude.print_mode("--continue", "Name another.")
    print("\n" + report(api, exchanges[seen:], second))
    assert second.returncode == 0 and second.stdout.strip(), report(api, exchanges, first, second)
    assert second.seconds < RUN_LIMIT_S, report(api, exchanges, first, second)
    # The client set no temperature and asked for 32,000 tokens or more: the server's defaults applied.
    bodies = [e.json() for e in main_turns(exchanges)]
    assert all("temperature" not in b and b["max_tokens"] > api.settings.max_output_tokens for b in bodies)

    before, after = main_turns(exchanges[:seen]), main_turns(exchanges[seen:])
    assert before and after, report(api, exchanges, first, second)
    # --continue resumes the same Claude Code session and resends the conversation so far.
    assert after[0].session == before[-1].session
    assert len(after[0].json()["messages"]) > len(before[-1].json()["messages"])
    last, resumed = before[-1].usage(), after[0].usage()
    print(f"\nlast turn of run 1: {last}\nfirst turn of --continue: {resumed}")
    assert resumed["cache_read_input_tokens"] >= last["input_tokens"] + last["cache_read_input_tokens"]
    prompt = resumed["cache_read_input_tokens"] + resumed["input_tokens"] + resumed["cache_creation_input_tokens"]
    assert resumed["cache_read_input_tokens"] > 0.5 * prompt

    # The snapshot is republished a few times a second: wait for the one after the last finish.
    agent = wait_for(lambda: claude_code_agent_with_turns(api, 2), 30, "a Claude Code agent with two turns")
    assert after[0].session in agent["agent_id"] and agent["reuse_ratio"] > 0


def test_the_recorder_kept_what_claude_code_sent(
    claude: ClaudeCode, api: RealApi, exchanges: list[Exchange], trace_path: Path,
) -> None:
    """Runs after the print/continue test in this module: the trace holds its requests, secrets left out."""
    if not main_turns(exchanges):
        claude.print_mode("Name one colour.")
    sent = [e for e in exchanges if e.method == "POST" and e.path.startswith("/v1/messages")
            and not e.path.endswith("count_tokens")]
    lines = wait_for(lambda: _trace_lines(trace_path, len(sent)), 10, "every request in the trace")
    assert [(line["path"].split("?")[0], line["body"]) for line in lines] == [(e.path, e.json()) for e in sent]
    assert all("x-api-key" not in line["headers"] and "authorization" not in line["headers"] for line in lines)
    assert all(line["status"] == e.status for line, e in zip(lines, sent))
    if os.environ.get("SEMANTIC_SAVE_TRACE"):
        shutil.copyfile(trace_path, os.environ["SEMANTIC_SAVE_TRACE"])


def _trace_lines(path: Path, count: int) -> list[dict] | None:
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    # The recorder writes a line when the response has ended; the trace's order is when each was sent.
    return sorted(lines, key=lambda line: line["t"]) if len(lines) >= count else None


def test_semantic_launch_runs_claude_code_against_the_server_and_files_its_subagents_under_it(
    claude_binary: Path, api: RealApi, tmp_path: Path,
) -> None:
    """``semantic launch claude --name --priority -- ARGS`` as a user types it: the real CLI answers a turn under
    that name and level; a subagent request of the same session, sent with the headers Claude Code sends for one
    (``x-claude-code-agent-id``, ``x-claude-code-parent-agent-id``), is filed in the session's family as a
    subagent, which the workbench draws under the main agent."""
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    env = isolated_env(home)
    env["PATH"] = f"{claude_binary.parent}{os.pathsep}{env['PATH']}"
    argv = [*semantic_command(), "launch", "claude", "--url", api.url, "--name", "launched", "--priority", "2",
            "--", "--bare", "-p", "Name one colour."]
    run = run_cli(argv, project, env, RUN_LIMIT_S)
    assert run.returncode == 0 and run.stdout.strip(), run.describe()
    main = wait_for(lambda: next((a for a in api.stats()["agents"] if a["display_name"] == "launched"), None), 30,
                    "the launched agent, named")
    assert (main["agent_class"], main["priority"]) == ("main", 2), main
    session = main["family"].removeprefix("cc-")
    reply = httpx.post(f"{api.url}/v1/messages", timeout=120, json={
        "model": "claude-sonnet-4-5", "max_tokens": 40, "messages": [{"role": "user", "content": "Read a.py."}]},
        headers={"x-api-key": "any", "x-claude-code-session-id": session, "x-claude-code-agent-id": "task-1",
                 "x-claude-code-parent-agent-id": "main"})
    assert reply.status_code == 200, reply.text
    subagent = wait_for(lambda: next((a for a in api.stats()["agents"] if a["agent_class"] == "subagent"), None), 30,
                        "the subagent")
    assert subagent["family"] == main["family"] and subagent["parent"] == "main"
