"""`semantic --serve` in one tmux window and `semantic attach` in another, driven as a person would.

The real SmolLM2 serves headless; the attached workbench finds it through the
cache dir's record (no URL typed), shows an HTTP client's agent as it arrives,
evicts (`e`), pins (`p`) and forks (`f`) it on the server, lists a Claude Code
session, answers in a chat of its own (a direct-API agent of the server),
reconnects when the server restarts on its address, and quits while the
server keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine.api.listener_file import recorded_listener
from tests.support.distributed_run import free_port
from tests.support.terminal import TmuxTerminal, isolated_env, poll, semantic_command, tmux_available

pytestmark = [pytest.mark.skipif(not tmux_available(), reason="needs tmux (apt-get install tmux)"),
              pytest.mark.solo(reason="two terminal apps in tmux whose screens are read against time limits")]

READY_TIMEOUT_S = 180  # a busy 2-core box: loading and compiling can take long
TURN_TIMEOUT_S = 120
UI_TIMEOUT_S = 60
SESSION = "attach-real-5c1d"
AGENT = f"oa-{SESSION}"
CC_SESSION = "3f2a9c1e-attach-test"


def test_serve_in_one_window_attach_in_another(smollm2_path: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    env = isolated_env(tmp_path / "home")
    # A fixed port: the restarted server must come back where the attached workbench looks for it.
    serve_argv = [*semantic_command(), "--serve", "--model", str(smollm2_path), "--cache-dir", str(cache_dir),
                  "--port", str(free_port())]
    with TmuxTerminal(tmp_path / "serve-tty", name="serve") as server, server.dump_on_failure():
        server.start(serve_argv, env, cwd=tmp_path)
        url = poll(lambda: recorded_listener(cache_dir), READY_TIMEOUT_S)
        assert url, "the server never recorded its address in the cache dir"
        wait_ready(url)
        with TmuxTerminal(tmp_path / "attach-tty", name="attach") as attached, attached.dump_on_failure():
            attached.start([*semantic_command(), "attach", "--cache-dir", str(cache_dir)], env, cwd=tmp_path)
            attached.wait_for_text(rf"{url}.*ready", "the server's address and state on the top line", UI_TIMEOUT_S)

            one_turn(url)
            attached.wait_for_text(rf"│ OpenAI session {SESSION[:7]}\S*\s+OpenAI\s+idle\s+hot\b",
                                   "the HTTP client's agent, hot", UI_TIMEOUT_S)
            attached.press("e")  # the only row is selected
            attached.wait_for_text(rf"│ OpenAI session {SESSION[:7]}\S*\s+OpenAI\s+idle\s+warm\b",
                                   "the agent evicted to disk", UI_TIMEOUT_S)
            assert agent_tier(url) == "warm"
            attached.wait_for_text(r"evict\s", "the server's eviction in the log pane", UI_TIMEOUT_S)
            attached.press("p")
            assert poll(lambda: agent(url)["pinned"], UI_TIMEOUT_S), "p did not pin the agent on the server"
            attached.press("f")
            assert poll(lambda: agent(url, f"{AGENT}-fork-1"), UI_TIMEOUT_S), "f made no fork on the server"
            attached.wait_for_text(rf"{AGENT}-fork-1|fork of OpenAI", "the fork listed", UI_TIMEOUT_S)

            claude_code_turn(url)
            attached.wait_for_text(rf"│ Claude Code {CC_SESSION[:8]}\S*\s+Claude Code\s+idle\s+hot\b",
                                   "the Claude Code session's agent", UI_TIMEOUT_S)

            attached.press("n")  # a chat of the attached workbench: a direct-API agent of the server
            attached.wait_for_text(r"chat-1", "the new chat pane", UI_TIMEOUT_S)
            attached.type_text("Reply with the single word: yes")
            attached.press("Enter")
            attached.wait_for_text(r"reused \d+ · prefilled \d+ · generated \d+", "the chat's reply and usage line",
                                   TURN_TIMEOUT_S)
            chat = httpx.get(f"{url}/v1/agents/chat-1", timeout=10).json()
            assert chat["source"] == "api" and chat["turns"] == 1 and chat["messages"] == 2

            server.press("C-c")  # the server stops (its agents persisted) and comes back on the same address
            assert server.wait_exit(READY_TIMEOUT_S) == 0
            attached.wait_for_text(rf"cannot reach {url}", "the lost server on the top line", UI_TIMEOUT_S)
            with TmuxTerminal(tmp_path / "serve-again-tty", name="serve-again") as again, again.dump_on_failure():
                again.start(serve_argv, env, cwd=tmp_path)
                wait_ready(url)
                attached.wait_for_text(rf"{url}.*ready", "reconnected to the restarted server", UI_TIMEOUT_S)
                assert one_turn(url)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # back from disk
                attached.wait_for_text(rf"│ OpenAI session {SESSION[:7]}\S*\s+OpenAI\s+idle\s+hot\b",
                                       "the agent's turn on the restarted server", UI_TIMEOUT_S)

                attached.press("C-q")  # the chat's input has the focus: ctrl+q quits from there
                assert attached.wait_exit(UI_TIMEOUT_S) == 0
                assert httpx.get(f"{url}/health/ready", timeout=10).status_code == 200  # quitting left it serving


def wait_ready(url: str) -> None:
    """Until the server answers ready (a server just started may not listen yet)."""
    def ready() -> bool:
        try:
            return httpx.get(f"{url}/health/ready", timeout=10).status_code == 200
        except httpx.ConnectError:
            return False

    assert poll(ready, READY_TIMEOUT_S), "the server never became ready"


def one_turn(url: str) -> dict:
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8,
            "temperature": 0, "session_id": SESSION}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TURN_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


def claude_code_turn(url: str) -> None:
    """A turn as Claude Code sends it: Anthropic Messages with its session header."""
    body = {"model": "claude-sonnet-4-5", "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}
    reply = httpx.post(f"{url}/v1/messages", json=body, timeout=TURN_TIMEOUT_S,
                       headers={"x-claude-code-session-id": CC_SESSION, "anthropic-version": "2023-06-01"})
    assert reply.status_code == 200, reply.text


def agent(url: str, agent_id: str = AGENT) -> dict | None:
    agents = {a["agent_id"]: a for a in httpx.get(f"{url}/v1/stats", timeout=10).json()["agents"]}
    return agents.get(agent_id)


def agent_tier(url: str) -> str:
    return agent(url)["tier"]
