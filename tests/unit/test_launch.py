"""``semantic launch claude|codex``: the variables and overrides each client gets, the flags checked, and the
command run against a server (a stand-in client here; tests/model/test_launch_real.py starts a real server and
test_claude_code_e2e.py runs the real Claude Code through it)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from semantic_cli.launch import client_headers, plan, split_client_args
from semantic_cli.main import main
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.unit


def test_claude_code_gets_the_base_url_a_key_its_side_model_and_the_headers() -> None:
    launched = plan("claude", "/bin/claude", "http://127.0.0.1:8642", None, "small",
                    client_headers("reviewer", "subagent"), ["-p", "hi"])
    assert launched.argv == ["/bin/claude", "-p", "hi"]
    assert launched.env == {
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:8642", "ANTHROPIC_API_KEY": "local",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "small",
        "ANTHROPIC_CUSTOM_HEADERS": "x-semantic-agent-name: reviewer\nx-semantic-priority: 3"}


def test_codex_gets_a_provider_and_the_served_model_as_overrides_and_the_servers_key() -> None:
    launched = plan("codex", "codex", "http://127.0.0.1:8642/", "sk-1", None, client_headers(None, "0"),
                    ["exec", "hi"], model="smollm2-135m")
    overrides = [launched.argv[i + 1] for i, a in enumerate(launched.argv) if a == "-c"]
    # Under its own default model name Codex 0.171 sends input items for OpenAI's hosted models
    # (additional_tools): it is told the served model, as a hand-written config.toml would.
    assert overrides == ['model="smollm2-135m"', 'model_provider="semantic"', 'model_providers.semantic.name="semantic"',
                         'model_providers.semantic.base_url="http://127.0.0.1:8642/v1"',
                         'model_providers.semantic.wire_api="responses"',
                         'model_providers.semantic.env_key="SEMANTIC_API_KEY"',
                         'model_providers.semantic.http_headers={ "x-semantic-priority" = "0" }']
    assert launched.argv[-2:] == ["exec", "hi"] and launched.env == {"SEMANTIC_API_KEY": "sk-1"}


@pytest.mark.parametrize("name, priority, flag", [("x" * 65, None, "--name"), (None, "soon", "--priority"),
                                                   (None, "10", "--priority")])
def test_bad_flags_name_themselves(name: str | None, priority: str | None, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        client_headers(name, priority)


def test_what_follows_the_double_dash_is_the_clients() -> None:
    assert split_client_args(["--port", "1", "launch", "claude", "--", "-p", "--", "x"]) == (
        ["--port", "1", "launch", "claude"], ["-p", "--", "x"])
    assert split_client_args(["--", "launch"]) == (["--", "launch"], [])


def test_a_missing_client_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["--cache-dir", str(tmp_path / "cache"), "launch", "codex", "--url", "http://127.0.0.1:9"]) == 127
    assert "npm install -g @openai/codex" in capsys.readouterr().err


def test_the_client_runs_against_the_server_with_its_arguments(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """A stand-in ``claude`` on PATH records its arguments and the variables it was given."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record.json"
    bin_dir.mkdir()
    fake = bin_dir / "claude"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
                    "sys.exit(3)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with LiveServer(build_app(make_service(tmp_path / "cache", ScriptedEngine()))) as live:
        code = main(["--cache-dir", str(tmp_path / "cache"), "launch", "claude", "--url", live.url,
                     "--priority", "background", "--", "-p", "Name one colour."])
    seen = json.loads(record.read_text())
    assert code == 3  # the client's own status
    assert seen["argv"] == ["-p", "Name one colour."]
    assert seen["env"]["ANTHROPIC_BASE_URL"] == live.url
    assert seen["env"]["ANTHROPIC_CUSTOM_HEADERS"] == "x-semantic-priority: 6"
    assert "ANTHROPIC_DEFAULT_HAIKU_MODEL" not in seen["env"]  # one model: no side model to name
