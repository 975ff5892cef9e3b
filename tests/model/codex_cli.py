"""The real Codex CLI (npm ``@openai/codex``), installed once outside the repository, pointed at a server.

Installed beside Claude Code (claude_code_cli.npm_prefix) and reused while its
binary runs; no node, npm or registry is a failed test with the reason. A run
is ``codex exec`` as a user types it, with what a user writes into
``$CODEX_HOME/config.toml`` for a custom provider (README, "Codex CLI") and
nothing else: no client option a user would not set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tests.model.claude_code_cli import ClaudeRun, install_npm_cli, run_cli

# The version whose requests platform.md records; its config keys are what the README documents.
PACKAGE = "@openai/codex@0.171"
RUN_TIMEOUT_S = 420
API_KEY_VARIABLE = "SEMANTIC_API_KEY"


def install_codex(prefix: Path) -> Path:
    return install_npm_cli(prefix, PACKAGE, "codex", "codex-cli")


def provider_config(base_url: str, model: str) -> str:
    """``config.toml`` as the README tells a user to write it."""
    return (f'model = "{model}"\nmodel_provider = "semantic"\n\n[model_providers.semantic]\nname = "semantic"\n'
            f'base_url = "{base_url}/v1"\nenv_key = "{API_KEY_VARIABLE}"\nwire_api = "responses"\n')


@dataclass(frozen=True, slots=True)
class Codex:
    """The CLI with a private CODEX_HOME (holding only the provider config) and project directory."""

    binary: Path
    base_url: str
    home: Path
    project: Path
    model: str

    def write_config(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.project.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(provider_config(self.base_url, self.model), encoding="utf-8")

    def env(self) -> dict[str, str]:
        # A minimal environment: nothing of the developer's own Codex setup may leak in.
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home.parent),
                "LANG": "C.UTF-8", "CODEX_HOME": str(self.home), API_KEY_VARIABLE: "local"}

    def exec(self, *args: str, timeout_s: float = RUN_TIMEOUT_S) -> ClaudeRun:
        """``codex exec --skip-git-repo-check ARGS`` (the project is no git repository)."""
        return run_cli([str(self.binary), "exec", "--skip-git-repo-check", *args], self.project, self.env(), timeout_s)
