"""The real workbench in a real pseudo-terminal: a private tmux server, keys in, screen text out.

tmux rather than pexpect: ``capture-pane`` hands back the screen as the user
sees it, already laid out, so a check is a regular expression over text, not
a terminal emulator fed with escape sequences. Each terminal runs its own tmux
server (``-S`` socket in its work directory) so parallel tests and a user's
own tmux sessions never see each other.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self, TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.2
# The status bar reads "... · http://127.0.0.1:PORT · ready · ..." once the model is loaded and HTTP listens.
READY = re.compile(r"(http://127\.0\.0\.1:\d+) · ready\b")
# The footer (the last line) while the app's own keys reach it: it lists "n New" (a chat's input has the focus otherwise; the
# footer's "^q Quit" shows either way, so it cannot tell).
APP_KEYS_FOOTER = re.compile(r"(?<!\^)\bn New\b[^\n]*\n?\Z")
# Lines above the screen that a failure dump includes: a traceback printed after the app left its screen.
DUMP_HISTORY = 30


class TerminalTimeout(AssertionError):
    """A screen condition did not come true in time; the message ends with the last screen."""


def tmux_available() -> bool:
    return shutil.which("tmux") is not None


def semantic_command() -> list[str]:
    """The installed ``semantic`` console script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("semantic")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "semantic_cli"]


def isolated_env(home: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with a private HOME and no SEMANTIC_* settings.

    A developer's own SEMANTIC_PORT or theme preferences must not change what a test sees.
    PYTHONPATH points at this checkout so the command imports the code under test even
    from an editable install made before a package was added.
    """
    env = {k: v for k, v in (base or os.environ).items() if not k.startswith("SEMANTIC_")}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    env.setdefault("TERM", "xterm-256color")  # tmux refuses to start a server without one
    return env


def poll(condition: Callable[[], T | None], timeout_s: float, interval_s: float = POLL_S) -> T | None:
    """The first truthy value of ``condition()`` within ``timeout_s``, else None."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)


class TmuxTerminal:
    """One command in a detached tmux pane of ``width`` x ``height`` cells."""

    def __init__(self, workdir: Path, width: int = 160, height: int = 48, name: str = "workbench") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.width, self.height, self.name = width, height, name
        self.socket = workdir / "tmux.sock"
        self.status_file = workdir / "exit-status"
        self._env: dict[str, str] = {}

    # -- life cycle ---------------------------------------------------------------------------
    def start(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        """Run ``argv``; its exit status lands in ``status_file`` and the pane stays for a last look."""
        self._env = env
        self.status_file.unlink(missing_ok=True)
        shell = f"{shlex.join(argv)}; echo $? > {shlex.quote(str(self.status_file))}"
        # The server is started by this call, so the pane inherits exactly ``env``.
        size = ("-x", str(self.width), "-y", str(self.height))
        self._tmux("new-session", "-d", "-s", self.name, *size, "-c", str(cwd or self.workdir), shell,
                   ";", "set-option", "-t", self.name, "remain-on-exit", "on")

    def close(self) -> None:
        """Kill the server and with it whatever still runs in the pane (SIGHUP)."""
        if self.socket.exists():
            subprocess.run(["tmux", "-S", str(self.socket), "kill-server"], env=self._env or None,
                           capture_output=True, check=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- screen and keys ----------------------------------------------------------------------
    def screen(self, history: int = 0) -> str:
        """The visible screen, after ``history`` lines that scrolled off it.

        The workbench draws on the alternate screen, so the history holds what the
        process printed before it started drawing and after it exited (a traceback).
        """
        return self._tmux("capture-pane", "-p", "-t", self.name, "-S", str(-history)).stdout

    def press(self, *keys: str) -> None:
        """tmux key names: ``n``, ``Enter``, ``Tab``, ``C-q``."""
        self._tmux("send-keys", "-t", self.name, *keys)

    def type_text(self, text: str) -> None:
        """Literal text, never read as key names."""
        self._tmux("send-keys", "-t", self.name, "-l", text)

    def exit_status(self) -> int | None:
        text = self.status_file.read_text().strip() if self.status_file.exists() else ""
        return int(text) if text else None

    # -- waiting ------------------------------------------------------------------------------
    def wait_for(self, condition: Callable[[str], T | None], what: str, timeout_s: float) -> T:
        """The first truthy ``condition(screen)``; TerminalTimeout with the screen after ``timeout_s``."""
        found = poll(lambda: condition(self.screen()), timeout_s)
        if not found:
            raise TerminalTimeout(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.dump()}")
        return found

    def wait_for_text(self, pattern: str | re.Pattern[str], what: str, timeout_s: float) -> re.Match[str]:
        regex = re.compile(pattern)
        return self.wait_for(regex.search, what, timeout_s)

    def wait_exit(self, timeout_s: float) -> int:
        status = poll(lambda: self.exit_status() is not None, timeout_s)
        if not status:
            raise TerminalTimeout(f"the command did not exit within {timeout_s:.0f} s\n{self.dump()}")
        return self.exit_status()  # type: ignore[return-value]

    def dump(self) -> str:
        try:
            screen = self.screen(history=DUMP_HISTORY)
        except subprocess.CalledProcessError as exc:
            screen = f"(no screen: {exc.stderr.strip()})"
        return f"--- screen ({self.width}x{self.height}) ---\n{screen.rstrip()}\n--- end of screen ---"

    @contextmanager
    def dump_on_failure(self) -> Iterator[None]:
        """Print the last screen when the block fails (pytest shows it with the failure)."""
        try:
            yield
        except BaseException:
            print(self.dump())
            raise

    def _tmux(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-S", str(self.socket), *args], env=self._env or None,
                              capture_output=True, text=True, check=True)


# -- the workbench in particular ---------------------------------------------------------------


def wait_until_ready(terminal: TmuxTerminal, timeout_s: float) -> str:
    """Wait for the loaded model and the listening API; return the API's base URL from the status bar."""
    return terminal.wait_for_text(READY, "the status bar to show the HTTP URL and 'ready'", timeout_s).group(1)


def focus_off_inputs(terminal: TmuxTerminal, timeout_s: float = 10.0) -> None:
    """Press Tab until the app's own keys (q, n, ...) reach the app instead of a chat's input box."""
    def tabbed() -> bool:
        if APP_KEYS_FOOTER.search(terminal.screen()):
            return True
        terminal.press("Tab")
        return bool(poll(lambda: APP_KEYS_FOOTER.search(terminal.screen()), 1.0))

    if not poll(tabbed, timeout_s, interval_s=0):
        raise TerminalTimeout(f"the focus never left the chat input\n{terminal.dump()}")
