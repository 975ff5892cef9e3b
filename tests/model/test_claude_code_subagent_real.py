"""The real Claude Code CLI, started by ``semantic launch claude``, handing a task to its Agent tool: the subagent
it starts is filed under the main agent's session.

Against a tiny Qwen2 folder scripted by hand (tests/support/scripted_agent.py): the main agent's first reply
calls ``Agent`` with the prompt "Kumquat"; Claude Code starts a subagent with that prompt, whose reply is
"Zyzzyva."; the main agent's turn with the tool's result answers "It is finished." The answer is only written
when every step went through: Claude Code ran its Agent tool on the call the server parsed, the subagent's
request carried the task, and its answer came back as the tool's result. The server files the subagent by the
headers Claude Code sends for one (``x-claude-code-agent-id``) in the main agent's family, which the workbench
draws as a tree.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.model.claude_code_cli import install_claude_code, npm_prefix, run_cli
from tests.model.engine_fixtures import load_folder
from tests.model.real_api import running_api
from tests.model.request_log import Exchange, RequestLog
from tests.support.terminal import isolated_env, semantic_command
from tests.support.scripted_agent import FINAL_TEXT, SUBAGENT_TEXT, scripted_agent_model

pytestmark = [pytest.mark.model, pytest.mark.solo(reason="the real Claude Code CLI, held to a time limit")]

RUN_LIMIT_S = 180


def test_claude_codes_agent_tool_runs_a_subagent_filed_under_the_main_agent(smollm2_path: Path,
                                                                             tmp_path: Path) -> None:
    folder = scripted_agent_model(tmp_path / "scripted-agent", smollm2_path)
    binary = install_claude_code(npm_prefix())
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    env = isolated_env(home)
    env["PATH"] = f"{binary.parent}{os.pathsep}{env['PATH']}"
    exchanges: list[Exchange] = []
    with running_api(load_folder(folder, tmp_path / "load"), tmp_path / "cache", folder,
                     configure=lambda app: app.add_middleware(RequestLog, exchanges=exchanges)) as api:
        argv = [*semantic_command(), "launch", "claude", "--url", api.url, "--name", "lead", "--",
                "-p", "Hand the task to a helper."]
        run = run_cli(argv, project, env, RUN_LIMIT_S)
        agents = api.stats()["agents"]
    summary = "\n".join(e.summary() for e in exchanges) + "\n" + run.describe() + f"\nagents: {agents}"
    assert run.returncode == 0 and FINAL_TEXT in run.stdout, summary
    messages = [e for e in exchanges if e.path == "/v1/messages"]
    subagent_requests = [e for e in messages if "x-claude-code-agent-id" in e.headers]
    assert subagent_requests and all(e.status == 200 for e in subagent_requests), summary
    assert any(SUBAGENT_TEXT in e.reply_text() for e in subagent_requests), summary
    final = next(e for e in reversed(messages) if FINAL_TEXT in e.reply_text())
    usage = final.usage()  # the main agent's turn with the tool's result went on from its cache
    assert "x-claude-code-agent-id" not in final.headers and usage and usage["cache_read_input_tokens"] > 0, summary
    main = next((a for a in agents if a["display_name"] == "lead"), None)
    assert main is not None and main["agent_class"] == "main", summary
    subagents = [a for a in agents if a["agent_class"] == "subagent"]
    assert subagents and all(a["family"] == main["family"] for a in subagents), summary
