"""The real Claude Code CLI against a server with two resident models, set up as its docs say for a gateway.

``ANTHROPIC_DEFAULT_HAIKU_MODEL=side`` makes Claude Code name the side model
for its haiku tier; ``claude --model haiku`` then runs a whole session on that
tier. The server (SmolLM2 as ``--model``, Gemma 3 270M as ``--extra-model
side=...,side``; both real, so each run ends as a user's would) must serve
those requests with Gemma, list the session's agent under it, and leave the
default model alone; a plain ``claude -p`` run in the same project goes to
SmolLM2. Every request Claude Code sent is printed on a failure.

The server clamps each reply as test_claude_code_full_real.py's does (48 tokens or 20 s, greedy for
requests that name no temperature): Claude Code's prompt carries the date, and unclamped greedy replies
ran 26 s on 2026-12-01 and 139-169 s on 2026-12-02. A run then ends with an answer or with the CLI's
own exit after its fourth cut reply (``ClaudeRun.ended``); the routing and the caches are what is held.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine.api.app import create_app
from engine.api.service import EngineService
from engine.bootstrap import start_engine
from engine.settings import Settings
from tests.model.claude_code_cli import ClaudeCode, install_claude_code, npm_prefix, run_cli
from tests.model.request_log import Exchange, RequestLog
from tests.support.router_app import LiveServer

pytestmark = pytest.mark.solo(reason="the real Claude Code CLI, each run held to a time limit")

RUN_LIMIT_S = 180.0
# The server's clamps (test_claude_code_full_real.py): a run is at most four short replies.
CLAMPS = {"max_output_tokens": 48, "max_output_seconds": 20.0, "default_temperature": 0.0}


@contextlib.contextmanager
def two_models(default: Path, side: Path, cache_dir: Path, exchanges: list[Exchange]) -> Iterator[str]:
    config = Settings(cache_dir=cache_dir, model=str(default), extra_models=(f"side={side},side",),
                      pool_budget_mb=512, max_batch_size=8, api_key=None, **CLAMPS)
    engine = start_engine(config)
    service = EngineService(config, engine)
    service.serve_extra_models(engine)
    app = create_app(service)
    app.add_middleware(RequestLog, exchanges=exchanges)
    try:
        with LiveServer(app) as server:
            yield server.url
    finally:
        service.models.stop_all()
        engine.stop(0.0)


def test_claude_codes_haiku_tier_runs_on_the_side_model_and_its_main_model_on_the_default(
        smollm2_path: Path, gemma3_path: Path, tmp_path: Path) -> None:
    exchanges: list[Exchange] = []
    with two_models(smollm2_path, gemma3_path, tmp_path / "cache", exchanges) as url:
        (tmp_path / "home").mkdir()
        (tmp_path / "project").mkdir()
        claude = ClaudeCode(install_claude_code(npm_prefix()), url, tmp_path / "home", tmp_path / "project")
        env = {**claude.env(), "ANTHROPIC_DEFAULT_HAIKU_MODEL": "side"}

        side = run_cli([str(claude.binary), "--bare", "--model", "haiku", "-p", "Name one colour."],
                       claude.project, env, RUN_LIMIT_S)
        said = "\n".join(e.summary() for e in exchanges)
        assert side.ended(), side.describe() + "\n" + said
        sent = [e.json().get("model") for e in exchanges if e.path.startswith("/v1/messages")
                and not e.path.endswith("count_tokens")]
        assert sent and set(sent) == {"side"}, said
        models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert models["side"]["state"] == "resident" and models["side"]["requests_routed"] == len(sent)
        agents = httpx.get(f"{url}/v1/agents", timeout=30).json()["data"]
        claude_agents = {(a["model"], a["source"]) for a in agents if a["source"] == "claude-code"}
        assert claude_agents == {("side", "claude-code")}, agents

        seen = len(exchanges)
        main = run_cli([str(claude.binary), "--bare", "-p", "Name one colour."], claude.project, env, RUN_LIMIT_S)
        said = "\n".join(e.summary() for e in exchanges[seen:])
        assert main.ended(), main.describe() + "\n" + said
        main_models = {e.json().get("model") for e in exchanges[seen:] if e.path.startswith("/v1/messages")
                       and not e.path.endswith("count_tokens")}
        assert main_models and not any("haiku" in m or m == "side" for m in main_models), said
        agents = httpx.get(f"{url}/v1/agents", timeout=30).json()["data"]
        assert {a["model"] for a in agents if a["source"] == "claude-code"} == {"side", str(smollm2_path)}
