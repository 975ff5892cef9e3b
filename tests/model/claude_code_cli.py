"""The real Claude Code CLI from npm, installed once outside the repository (codex_cli.py: Codex's).

The install lives in ``$SEMANTIC_TEST_NPM_PREFIX`` or
``~/.cache/semantic-test/npm`` and is reused while its binary runs. No node,
no npm or no registry is a failed test with the reason, never a skip: the
end-to-end test is the evidence that Claude Code works, and a silent pass
would hide that it never ran.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "@anthropic-ai/claude-code@2"
INSTALL_TIMEOUT_S = 600
# A hard stop for a hung run, well past the 120 s a run must take (the tests time runs themselves).
RUN_TIMEOUT_S = 300
KILLED = -9  # ClaudeRun.returncode of a run stopped at its timeout


def npm_prefix() -> Path:
    configured = os.environ.get("SEMANTIC_TEST_NPM_PREFIX")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "semantic-test" / "npm"


def version_of(binary: Path, marker: str = "Claude Code") -> str | None:
    """``BINARY --version`` output when it names ``marker``; None when the binary is missing or does not run."""
    if not binary.exists():
        return None
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and marker in done.stdout else None


def install_npm_cli(prefix: Path, package: str, name: str, marker: str) -> Path:
    """The ``name`` binary of ``package`` under ``prefix``, installing it with npm when it is not there yet."""
    binary = prefix / "node_modules" / ".bin" / name
    if version_of(binary, marker):
        return binary
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the {marker} end-to-end test needs {' and '.join(missing)} "
                    "(apt-get install nodejs npm); it cannot run without them", pytrace=False)
    prefix.mkdir(parents=True, exist_ok=True)
    argv = ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", package]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(argv)}` took over {INSTALL_TIMEOUT_S} s: is the npm registry reachable?",
                    pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"`{' '.join(argv)}` failed (status {done.returncode}); is the npm registry reachable?\n"
                    f"{done.stderr[-3000:]}", pytrace=False)
    if not version_of(binary, marker):
        pytest.fail(f"npm installed {package} into {prefix} but {binary} --version does not run "
                    f"(was its postinstall script blocked?)\n{done.stderr[-3000:]}", pytrace=False)
    return binary


def install_claude_code(prefix: Path) -> Path:
    """The ``claude`` binary under ``prefix``, installing it with npm when it is not there yet."""
    return install_npm_cli(prefix, PACKAGE, "claude", "Claude Code")


@dataclass(frozen=True, slots=True)
class ClaudeRun:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float = 0.0

    @property
    def timed_out(self) -> bool:
        return self.returncode == KILLED

    @property
    def gave_up_at_output_limit(self) -> bool:
        """The CLI's own end after a reply was cut at ``max_tokens`` four times in a row.

        Claude Code resumes a reply that stopped at ``max_tokens`` ("Output token limit hit.
        Resume directly ...") up to three times, then exits with status 1 and "API Error:
        Claude's response exceeded the 64000 output token maximum" (2.1.197). A sampled small
        model that writes a list without end gets there; the server's part (each reply cut at
        its clamp, each resume reading the cache) is what a test can hold it to.
        """
        return self.returncode == 1 and "output token maximum" in self.stdout

    def ended(self) -> bool:
        """The run finished by itself: an answer, or the CLI's end at the output limit."""
        return (self.returncode == 0 and bool(self.stdout.strip())) or self.gave_up_at_output_limit

    def describe(self) -> str:
        status = "killed at its timeout" if self.timed_out else f"status {self.returncode}"
        return (f"$ {' '.join(self.argv)}\n{status} after {self.seconds:.1f} s\n"
                f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}")


@dataclass(frozen=True, slots=True)
class ClaudeCode:
    """The CLI pointed at one server, with a private HOME and project directory."""

    binary: Path
    base_url: str
    home: Path
    project: Path

    def env(self) -> dict[str, str]:
        # A minimal environment: nothing of the developer's own Claude Code setup may leak in.
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "ANTHROPIC_BASE_URL": self.base_url,
            "ANTHROPIC_API_KEY": "any",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }

    def print_mode(self, *args: str, bare: bool = True, timeout_s: float = RUN_TIMEOUT_S) -> ClaudeRun:
        """``claude [--bare] -p ARGS`` as a user types it: no output cap, no turn limit.

        A run still going at ``timeout_s`` is killed and returned (``timed_out``), so the
        caller's assertion can show what the server saw and generated meanwhile.
        """
        return run_cli([str(self.binary), *(["--bare"] if bare else []), "-p", *args], self.project, self.env(),
                       timeout_s)


def run_cli(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> ClaudeRun:
    """Run a CLI to its end with no stdin, as a user's one-shot command; killed (``timed_out``) at ``timeout_s``."""
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        return ClaudeRun(argv, KILLED, _text(exc.stdout), _text(exc.stderr), time.monotonic() - started)
    return ClaudeRun(argv, done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def _text(output: str | bytes | None) -> str:
    # TimeoutExpired carries bytes even when the run asked for text.
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def project_with_png(root: Path, name: str, seed: int, width: int, height: int) -> tuple[Path, Path]:
    """A private HOME and a project directory under ``root``, the project holding a random RGB PNG ``name``."""
    import io

    import numpy as np
    from PIL import Image

    home, project = root / "home", root / "project"
    home.mkdir()
    project.mkdir()
    out = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(out, "PNG")
    (project / name).write_bytes(out.getvalue())
    return home, project
