"""`semantic --serve` as a process with the real SmolLM2: it answers health
probes while loading, serves one Anthropic request, and on SIGTERM exits 0
after writing the agent's cache to the warm tier."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.store.cache_file import cache_file_path

pytestmark = pytest.mark.solo(reason="a shutdown held to its grace period")

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 5
SESSION = "0b6f7b64-3c1e-4c55-9a53-5e7a1c0ffee1"


def start_server(model: Path, cache_dir: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SEMANTIC_CACHE_DIR": str(cache_dir)}
    argv = [sys.executable, "-m", "semantic_cli", "--serve", "--port", "0", "--model", str(model),
            "--shutdown-grace-s", str(GRACE_S)]
    # stderr is a pipe, not a terminal, so the logs are JSON lines.
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def read_port(process: subprocess.Popen[str], log: list[str], timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    assert process.stderr is not None
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        log.append(line)
        if line.startswith("{") and json.loads(line).get("msg", "").startswith("listening on"):
            return int(json.loads(line)["port"])
    raise AssertionError("no 'listening on' log line:\n" + "".join(log))


def wait_ready(url: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = httpx.get(f"{url}/health/ready")
        if response.status_code == 200:
            return response.json()
        assert response.status_code == 503 and response.headers["retry-after"]
        time.sleep(0.2)
    raise AssertionError("never ready")


def hot_agent(url: str, timeout_s: float = 5) -> dict:
    """The one agent, once the engine has published a snapshot showing its cache."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agents = httpx.get(f"{url}/v1/stats").json()["agents"]
        if agents and agents[0]["tier"] == "hot":
            (agent,) = agents
            return agent
        time.sleep(0.05)
    raise AssertionError(f"no hot agent in /v1/stats: {agents}")


def test_serve_answers_then_exits_0_on_sigterm_with_the_cache_on_disk(smollm2_path: Path, tmp_path: Path) -> None:
    process = start_server(smollm2_path, tmp_path)
    log: list[str] = []
    try:
        url = f"http://127.0.0.1:{read_port(process, log)}"
        assert wait_ready(url)["model"] == smollm2_path.name
        body = {"model": "claude-opus-5-5", "max_tokens": 48,
                "messages": [{"role": "user", "content": "Name three colours."}]}
        reply = httpx.post(f"{url}/v1/messages", json=body, headers={"x-claude-code-session-id": SESSION}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["content"][0]["text"].strip()
        agent = hot_agent(url)
        assert SESSION in agent["agent_id"]

        process.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert process.wait(timeout=GRACE_S + 30) == 0
        assert time.monotonic() - began < GRACE_S
    finally:
        process.kill()
        log += process.stderr.readlines() if process.stderr else []
    model_dirs = [d for d in (tmp_path / "agents").iterdir() if d.is_dir()]
    assert len(model_dirs) == 1, "".join(log)
    assert cache_file_path(model_dirs[0], agent["agent_id"]).is_file(), "".join(log)
