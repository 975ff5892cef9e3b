"""``semantic launch`` with no server running: it starts ``semantic --serve`` on the real SmolLM2 with its own
settings, runs the client against it with the variables it sets, and stops the server when the client exits.

The client is a stand-in that does what Claude Code does with those variables (its base URL, its key, its
custom headers, its session header): one streamed-free /v1/messages turn, then it prints the reply and the
agent the server filed it under. The real Claude Code CLI through ``semantic launch`` is in
test_claude_code_e2e.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine.api.listener_file import recorded_listener
from tests.support.terminal import isolated_env, semantic_command

pytestmark = pytest.mark.model

STAND_IN = """
import json, os, sys, httpx
headers = dict(line.split(": ", 1) for line in os.environ["ANTHROPIC_CUSTOM_HEADERS"].splitlines())
headers.update({"x-api-key": os.environ["ANTHROPIC_API_KEY"], "x-claude-code-session-id": "launch-session-1"})
base = os.environ["ANTHROPIC_BASE_URL"]
reply = httpx.post(base + "/v1/messages", headers=headers, timeout=300, json={
    "model": "claude-sonnet-4-5", "max_tokens": 48, "messages": [{"role": "user", "content": sys.argv[1]}]})
reply.raise_for_status()
agents = httpx.get(base + "/v1/agents", timeout=30).json()["data"]
print(json.dumps({"text": reply.json()["content"][0]["text"], "agents": agents}))
"""


def test_launch_starts_a_server_runs_the_client_against_it_and_stops_it(smollm2_path: Path, tmp_path: Path) -> None:
    bin_dir, cache_dir = tmp_path / "bin", tmp_path / "cache"
    bin_dir.mkdir()
    client = bin_dir / "claude"
    client.write_text(f"#!{sys.executable}\n{STAND_IN}")
    client.chmod(client.stat().st_mode | stat.S_IEXEC)
    env = isolated_env(tmp_path / "home")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    argv = [*semantic_command(), "--model", str(smollm2_path), "--cache-dir", str(cache_dir), "--port", "0",
            "launch", "claude", "--name", "launch-check", "--priority", "2", "--", "Say hello."]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["text"].strip()
    agent = next(a for a in result["agents"] if a["display_name"] == "launch-check")
    assert (agent["agent_class"], agent["family"], agent["priority"]) == ("main", "cc-launch-session-1", 2)
    assert "starting one" in done.stderr and "stopping the server it started" in done.stderr
    assert recorded_listener(cache_dir) is None  # the server it started is gone
