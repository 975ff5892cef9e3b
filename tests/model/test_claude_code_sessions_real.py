"""Four Claude Code sessions at once, one with a subagent, on the real SmolLM2 through the HTTP API.

The requests have Claude Code's shape (protocol.md: a billing line and two
system blocks, tools, a mid-conversation system message, the session header,
``x-claude-code-agent-id`` on the subagent's requests, 32,000 max_tokens,
no temperature), sized down so the test fits a CPU: a ~1,500-token system
prompt and tool list instead of ~12,000.

What must hold: the sessions share the common prefix (only one of them
computes it); the subagent is an agent of its own that shares it too and
never trims or evicts its parent's cache; and every session's second turn
reuses more than 80% of its prompt.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.model.real_api import RealApi, running_api, wait_for
from tests.model.sse_grammar import check_anthropic_stream

pytestmark = pytest.mark.solo(reason="the real Claude Code CLI in five sessions, each held to a time limit")

TIMEOUT = httpx.Timeout(600, connect=30)
RULES = "\n".join(f"- Rule {i}: keep module m{i} under {40 + i} lines and run test t{i} after editing it."
                  for i in range(70))
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=sdk-cli;"},
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
     "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": f"You are an interactive CLI tool that helps users with software engineering tasks.\n"
                             f"{RULES}", "cache_control": {"type": "ephemeral"}},
]
TOOLS = [
    {"name": "Bash", "description": "Run a shell command.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
    {"name": "Read", "description": "Read a file.",
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}},
]
TASKS = ["List the files.", "What does main.py do?", "Run the tests.", "Explain the README."]


def request(messages: list[dict]) -> dict:
    return {"model": "claude-opus-5-5", "max_tokens": 32000, "stream": True, "system": SYSTEM, "tools": TOOLS,
            "messages": messages}


def first_messages(task: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>cwd: /repo</system-reminder>"},
                                         {"type": "text", "text": task}]},
            {"role": "system", "content": "Environment: linux, git repository."}]


@pytest.fixture(scope="module")
def api(smollm2, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApi]:
    # A server setting, not a client one: this test is about sharing, and short replies keep it short.
    with running_api(smollm2, tmp_path_factory.mktemp("sessions-cache"), smollm2_path, max_output_tokens=48) as running:
        yield running


async def turn(client: httpx.AsyncClient, headers: dict[str, str], messages: list[dict]) -> tuple[str, dict]:
    async with client.stream("POST", "/v1/messages?beta=true", json=request(messages), headers=headers) as response:
        raw = (await response.aread()).decode()
    assert response.status_code == 200, raw
    stream = check_anthropic_stream(raw)
    return stream.text, {**stream.start_usage, **stream.final_usage}


async def session(client: httpx.AsyncClient, task: str, subagent: bool) -> dict:
    sid = str(uuid.uuid4())
    headers = {"x-claude-code-session-id": sid, "anthropic-version": "2023-06-01", "x-api-key": "any"}
    messages = first_messages(task)
    reply, first = await turn(client, headers, messages)
    messages = messages + [{"role": "assistant", "content": reply or "OK."},
                           {"role": "user", "content": "Now do it again, briefly."}]
    sub = None
    if subagent:
        sub_headers = {**headers, "x-claude-code-agent-id": "a1b2c3d4"}
        _, sub = await turn(client, sub_headers, first_messages("Search the code for TODO."))
    _, second = await turn(client, headers, messages)
    return {"session": sid, "first": first, "second": second, "sub": sub}


def prompt_of(usage: dict) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


async def run_sessions(url: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        return list(await asyncio.gather(*(session(client, task, i == 0) for i, task in enumerate(TASKS))))


def test_four_sessions_and_a_subagent_share_the_prefix_and_reuse_their_own_caches(api: RealApi) -> None:
    results = asyncio.run(run_sessions(api.url))
    firsts = [r["first"] for r in results]
    # One session computed the shared prefix; the others read it from the pool.
    assert sum(1 for u in firsts if u["cache_read_input_tokens"] == 0) == 1, firsts
    shared = [u["cache_read_input_tokens"] for u in firsts if u["cache_read_input_tokens"]]
    assert min(shared) >= 0.8 * prompt_of(firsts[0]), firsts
    for r in results:
        second = r["second"]
        assert second["cache_read_input_tokens"] > 0.8 * prompt_of(second), r
    sub = results[0]["sub"]
    assert sub["cache_read_input_tokens"] > 0.5 * prompt_of(sub), sub  # the subagent shares the prefix too

    stats = wait_for(lambda: _settled(api), 30, "every agent idle")
    agents = {a["agent_id"]: a for a in stats["agents"] if a["source"] == "claude-code"}
    parent_id = next(a for a in agents if results[0]["session"] in a and "-sub-" not in a)
    sub_id = next(a for a in agents if results[0]["session"] in a and "-sub-" in a)
    parent = agents[parent_id]
    # The subagent is its own agent; its parent's cache is whole and still in memory.
    assert parent["tier"] == "hot" and sub_id != parent_id
    assert parent["cached_tokens"] >= prompt_of(results[0]["second"])
    assert stats["pool"]["shared_blocks"] > 0


def _settled(api: RealApi) -> dict | None:
    stats = api.stats()
    return stats if all(a["state"] == "idle" for a in stats["agents"]) else None
