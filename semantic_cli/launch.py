"""``semantic launch claude|codex [-- ARGS]``: the real client, configured against semantic, in one command.

It finds the running server (the URL given, else the one recorded in the cache dir), or starts one with
``semantic --serve`` and the same settings (stopped again when the client exits), then runs the client with
what it needs, and nothing of the user's own set-up changed (docs/launch.md lists every variable):

- Claude Code: ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``, ``ANTHROPIC_DEFAULT_HAIKU_MODEL`` (the side model
  where several models are resident), ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`` (its telemetry and update
  checks, which a local server cannot answer), and ``ANTHROPIC_CUSTOM_HEADERS`` for ``--name``/``--priority``.
- Codex CLI: a ``semantic`` model provider given as ``-c`` overrides (base URL, the Responses API, the key's
  variable, ``http_headers`` for ``--name``/``--priority``), so ``~/.codex/config.toml`` is left as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine.api.identity import AGENT_NAME_HEADER
from engine.api.request_priority import PRIORITY_HEADER
from engine.domain.priority import parse_level
from engine.errors import SemanticError
from engine.settings import Settings

CLIENTS = {
    "claude": ("claude", "npm install -g @anthropic-ai/claude-code"),
    "codex": ("codex", "npm install -g @openai/codex"),
}
LOCAL_KEY = "local"  # any key works on a server without --api-key
START_TIMEOUT_S = 900.0  # a first start may import a model and warm it up on a slow CPU


def split_client_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``semantic ... launch CLIENT [OPTIONS] -- ARGS``: (semantic's arguments, the client's ARGS)."""
    if "launch" in argv and "--" in argv[argv.index("launch"):]:
        at = argv.index("--", argv.index("launch"))
        return argv[:at], argv[at + 1:]
    return argv, []


def add_launch_command(commands: Any) -> None:
    launch = commands.add_parser(
        "launch", help="run Claude Code or Codex CLI against semantic (the running server, or one it starts)",
        description="Run the real Claude Code or Codex CLI configured against semantic: the running server "
        "recorded in the cache dir (or --url), else a `semantic --serve` started with these settings and stopped "
        "when the client exits. Arguments after -- go to the client. See docs/launch.md for what it sets.")
    launch.add_argument("client", choices=sorted(CLIENTS),
                        help="which client to run; arguments after -- go to it (e.g. -- -p 'Explain this code')")
    launch.add_argument("--url", help="the server's address (default: the one recorded in the cache dir while it "
                        "runs; else one is started)")
    launch.add_argument("--name", help="the agents' name in the workbench (sent as x-semantic-agent-name)")
    launch.add_argument("--priority", help="the agents' priority level, 0 (most urgent) to 9, or a class name "
                        "(interactive, main, side, subagent, background); sent as x-semantic-priority")
    launch.add_argument("--dry-run", action="store_true",
                        help="print the command and the variables it would set, and run nothing")
    launch.add_argument("--cache-dir", dest="cache_dir", type=Path, default=argparse.SUPPRESS, metavar="PATH",
                        help="the cache dir whose running server to use or start [env SEMANTIC_CACHE_DIR]")


@dataclass(frozen=True, slots=True)
class Launch:
    """What runs: the client's argv and the variables set for it (on top of the user's own environment)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"{name}={value!r}" if "\n" in value else f"{name}={value}" for name, value in self.env.items()]
        return "\n".join([*lines, " ".join(_quoted(a) for a in self.argv)])


def plan(client: str, binary: str, url: str, api_key: str | None, side_model: str | None,
         headers: dict[str, str], args: list[str], model: str | None = None) -> Launch:
    """The client's command and variables against the server at ``url``; ``model``: the served model's alias,
    which Codex is told as its model (under its own default model name it sends input items meant for
    OpenAI's hosted models, such as ``additional_tools``)."""
    key = api_key or LOCAL_KEY
    if client == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        if side_model is not None:
            env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] = side_model
        if headers:
            env["ANTHROPIC_CUSTOM_HEADERS"] = "\n".join(f"{k}: {v}" for k, v in headers.items())
        return Launch([binary, *args], env)
    provider = "model_providers.semantic"
    overrides = [f"model={json.dumps(model)}"] if model else []
    overrides += ['model_provider="semantic"', f'{provider}.name="semantic"',
                 f"{provider}.base_url={json.dumps(url.rstrip('/') + '/v1')}", f'{provider}.wire_api="responses"',
                 f'{provider}.env_key="SEMANTIC_API_KEY"']
    if headers:
        table = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in headers.items())
        overrides.append(f"{provider}.http_headers={{ {table} }}")
    return Launch([binary, *[a for o in overrides for a in ("-c", o)], *args], {"SEMANTIC_API_KEY": key})


def client_headers(name: str | None, priority: str | None) -> dict[str, str]:
    """The headers ``--name`` and ``--priority`` become; ValueError naming the flag when one is bad."""
    headers: dict[str, str] = {}
    if name:
        if len(name) > 64 or not name.isprintable():
            raise ValueError("--name must be 1-64 printable characters")
        headers[AGENT_NAME_HEADER] = name
    if priority is not None:
        headers[PRIORITY_HEADER] = str(parse_level(priority, "--priority"))
    return headers


def served_models(url: str, api_key: str | None) -> tuple[str | None, str | None]:
    """(the default model's alias, the resident side model's alias (``--extra-model ...,side``) for Claude
    Code's haiku tier); None where the server has none or does not answer."""
    try:
        response = httpx.get(f"{url}/v1/models", headers=_auth(api_key), timeout=10)
        response.raise_for_status()
        rows = response.json().get("data", [])
    except (httpx.HTTPError, ValueError):
        return None, None
    default = next((row["id"] for row in rows if row.get("loaded") and row.get("role") in (None, "main")), None)
    return default, next((row["id"] for row in rows if row.get("role") == "side"), None)


def launch(settings: Settings, args: argparse.Namespace) -> int:
    binary_name, install = CLIENTS[args.client]
    try:
        headers = client_headers(args.name, args.priority)
    except ValueError as exc:
        print(f"semantic launch: {exc}", file=sys.stderr)
        return 2
    binary = shutil.which(binary_name)
    if binary is None and not args.dry_run:
        print(f"semantic launch: {binary_name} is not on PATH; install it with: {install}", file=sys.stderr)
        return 127
    key = settings.api_key.get_secret_value() if settings.api_key else None
    client_args = list(getattr(args, "client_args", ()))
    url = _running_server(settings, args.url)
    server: subprocess.Popen | None = None
    if url is None and not args.dry_run:
        url, server = _start_server(settings)
    served, side = served_models(url, key) if url is not None else (None, None)
    launched = plan(args.client, binary or binary_name, url or _default_url(settings), key, side, headers,
                    client_args, model=served)
    if args.dry_run:
        print(launched.describe())
        return 0
    try:
        return subprocess.run(launched.argv, env={**os.environ, **launched.env}).returncode
    finally:
        if server is not None:
            print("semantic launch: stopping the server it started", file=sys.stderr)
            server.terminate()
            server.wait(timeout=60)


def _running_server(settings: Settings, url: str | None) -> str | None:
    from engine.api.listener_file import recorded_listener

    if url:
        return (url if "://" in url else f"http://{url}").rstrip("/")
    return recorded_listener(settings.cache_dir)


def _default_url(settings: Settings) -> str:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    return f"http://{host}:{settings.port}"


def _start_server(settings: Settings) -> tuple[str, subprocess.Popen]:
    """``semantic --serve`` with this process's settings and cache dir, once its API answers ready; its log in
    the cache dir."""
    from engine.api.listener_file import recorded_listener

    log_path = settings.cache_dir / "logs" / "launch-serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "semantic_cli", "--serve", *sys_settings_args()]
    print(f"semantic launch: no server is running; starting one (log: {log_path})", file=sys.stderr)
    with open(log_path, "ab") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "SEMANTIC_CACHE_DIR": str(settings.cache_dir)})
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SemanticError(f"the server it started exited with status {server.returncode}; see {log_path}")
        url = recorded_listener(settings.cache_dir)
        if url is not None and _ready(url, settings):
            return url, server
        time.sleep(0.5)
    server.terminate()
    raise SemanticError(f"the server it started was not ready after {START_TIMEOUT_S:.0f} s; see {log_path}")


def sys_settings_args() -> list[str]:
    """The settings flags this command was given (everything before the ``launch`` word), for the server."""
    argv = sys.argv[1:]
    return argv[:argv.index("launch")] if "launch" in argv else []


def _ready(url: str, settings: Settings) -> bool:
    key = settings.api_key.get_secret_value() if settings.api_key else None
    try:
        return httpx.get(f"{url}/health/ready", headers=_auth(key), timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _auth(api_key: str | None) -> dict[str, str]:
    return {"x-api-key": api_key} if api_key else {}


def _quoted(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
