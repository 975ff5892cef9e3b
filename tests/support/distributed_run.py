"""Drive `semantic --serve` as one process or as ranks under ``mlx.launch``, the way users start it.

A run is a fixed script of agent turns (several agents at once, then evict,
restore and restart steps chosen by the caller), so the same script against
one process and against two ranks must produce the same tokens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# How long a launcher may outlive its last rank after Ctrl+C before it counts as hung (see Launched.stop).
_LAUNCHER_GRACE_S = 20


def user_environ() -> dict[str, str]:
    """This environment less the test runner's OpenBLAS preload: each rank re-executes itself with
    OpenBLAS as a user's would, keeping the launcher's MLX_RANK and MLX_HOSTFILE."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int, avoid: int) -> int:
    """The first of ``n`` consecutive ports that all bind now and are not ``avoid``: mlx.launch's ring takes
    ``--starting-port`` and the ports after it, one a rank (one free port alone once left rank 1 on a port
    still bound: "[ring] Couldn't bind socket (error: 98)")."""
    for _ in range(100):
        base = free_port()
        ports = range(base, base + n)
        if avoid in ports or ports[-1] > 65535:
            continue
        sockets = []
        try:
            for port in ports:
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


@dataclass
class Launched:
    """One `semantic --serve` run (its process is the launcher when ranks > 1) and its log lines."""

    process: subprocess.Popen[str]
    url: str
    ranks: int = 1
    log: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    def start_reading(self) -> None:
        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.log.append(line)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def text(self) -> str:
        """The output so far; once the process has exited, all of it (its last lines may still be in the pipe)."""
        if self.process.poll() is not None and self._reader is not None:
            self._reader.join(10)
        return "".join(self.log)

    def wait_ready(self, timeout_s: float = 180) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"exited {self.process.returncode} before ready:\n{self.text()}")
            try:
                response = httpx.get(f"{self.url}/health/ready", timeout=5)
                if response.status_code == 200:
                    return response.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"never ready:\n{self.text()}")

    def stop(self, timeout_s: float = 180, launcher_grace_s: float = _LAUNCHER_GRACE_S) -> int:
        """Ctrl+C in the launcher's terminal: SIGINT to its whole process group, the launcher and every
        rank. Rank 0 ends the run; the others follow its last tick and write their shards.

        A stop takes ~1.5 s here, but under ``mlx.launch`` on two cores every rank runs several times
        slower than alone: the launcher's relay threads poll without sleeping and keep about a core
        busy (its relay also stops at Ctrl+C, so a slow stop's last lines are not in ``text()``).
        The generous limit is for that; what is still running at the limit is listed with its state.

        What is tested is that every rank exits. ``mlx.launch`` itself can hang after its ranks are
        gone (seen once in CI, mlx 0.32): Ctrl+C raised KeyboardInterrupt in its main thread inside
        ``Queue.put`` after the queue's lock was taken, so the relay thread of rank 0 waits on that lock
        forever, never reaps its rank (a zombie) and the launcher's exit waits on that thread. That is
        the launcher's bug, not a rank's: once no rank is left, a launcher still there after
        ``launcher_grace_s`` is killed and its status returned as -SIGKILL.
        """
        os.killpg(self.process.pid, signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        ranks_gone_at: float | None = None
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return self.process.returncode
                if self.ranks > 1 and not self._ranks_alive():
                    ranks_gone_at = ranks_gone_at or time.monotonic()
                    if time.monotonic() - ranks_gone_at > launcher_grace_s:
                        os.killpg(self.process.pid, signal.SIGKILL)
                        return self.process.wait(10)
                time.sleep(0.2)
            left = self._group_table()
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            raise AssertionError(f"still running {timeout_s:g} s after Ctrl+C:\n{left}\nits output:\n"
                                 f"{self.text()[-8000:]}")
        finally:
            if self.process.stdin is not None:
                self.process.stdin.close()
            if self._reader is not None:
                self._reader.join(5)

    def _group_table(self) -> str:
        return subprocess.run(["ps", "-o", "pid,stat,wchan:24,pcpu,etime,args", "-g", str(self.process.pid)],
                              capture_output=True, text=True).stdout

    def _ranks_alive(self) -> bool:
        """Whether a process of the run other than the launcher is still running (zombies are not)."""
        rows = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(self.process.pid)],
                              capture_output=True, text=True).stdout.split("\n")
        return any(int(pid) != self.process.pid and not stat.startswith("Z")
                   for pid, stat in (row.split() for row in rows if row.strip()))

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def launch(model: Path, cache_dir: Path, ranks: int, *extra: str, env: dict[str, str] | None = None) -> Launched:
    """`semantic --serve` alone (ranks == 1) or `mlx.launch --backend ring -n N -- semantic --serve`."""
    port = free_port()
    settings = {"SEMANTIC_CACHE_DIR": str(cache_dir), "SEMANTIC_PORT": str(port), "SEMANTIC_LOG_JSON": "true",
                "SEMANTIC_POOL_BUDGET_MB": "64"}
    serve = [str(VENV_BIN / "semantic"), "--serve", "--model", str(model), *extra]
    if ranks == 1:
        argv = serve
    else:
        argv = [str(VENV_BIN / "mlx.launch"), "--backend", "ring", "-n", str(ranks),
                "--starting-port", str(free_port_run(ranks, port)), *[f"--env={k}={v}" for k, v in settings.items()], "--", *serve]
    # The launcher's stdin is a pipe nobody writes to, like a terminal nobody types in. At the test
    # runner's stdin (often /dev/null, at end of file at once) its main loop would spin relaying empty
    # reads, and Ctrl+C would most likely land in the middle of one (see Launched.stop).
    process = subprocess.Popen(argv, cwd=ROOT, env={**user_environ(), **settings, **(env or {})}, text=True,
                               stdin=subprocess.PIPE if ranks > 1 else subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    launched = Launched(process, f"http://127.0.0.1:{port}", ranks)
    launched.start_reading()
    return launched


def create_agents(url: str, names: list[str]) -> None:
    for name in names:
        response = httpx.post(f"{url}/v1/agents", json={"agent_id": name, "system": f"You are {name}."}, timeout=30)
        assert response.status_code == 201, response.text


def say(url: str, agent: str, content: str, max_tokens: int = 24) -> dict:
    response = httpx.post(f"{url}/v1/agents/{agent}/messages", timeout=300,
                          json={"content": content, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def say_all(url: str, turns: dict[str, str]) -> dict[str, dict]:
    """One message to each agent, all at once (they share the batch)."""
    with ThreadPoolExecutor(len(turns)) as pool:
        futures = {agent: pool.submit(say, url, agent, content) for agent, content in turns.items()}
        return {agent: future.result() for agent, future in futures.items()}


def evict(url: str, agent: str, tier: str = "warm") -> None:
    response = httpx.post(f"{url}/v1/agents/{agent}/evict", json={"tier": tier}, timeout=60)
    assert response.status_code == 200, response.text


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@dataclass
class Rank:
    """One rank started by hand (``MLX_RANK`` and ``MLX_HOSTFILE``, as ``mlx.launch`` sets them)."""

    rank: int
    process: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    def start_reading(self) -> None:
        assert self.process.stdout is not None
        self._reader = threading.Thread(target=lambda: self.log.extend(iter(self.process.stdout.readline, "")),
                                        daemon=True)
        self._reader.start()

    def text(self) -> str:
        """The output so far; once the process has exited, all of it (its last lines may still be in the pipe)."""
        if self.process.poll() is not None and self._reader is not None:
            self._reader.join(10)
        return "".join(self.log)


def wait_ranks_ready(ranks: list[Rank], url: str, timeout_s: float = 120) -> None:
    """Until rank 0 answers ready at ``url``; AssertionError, with its output, when a rank exits first or
    the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r.process.poll() is not None for r in ranks):
            raise AssertionError("a rank exited before ready:\n" + "".join(r.text()[-3000:] for r in ranks))
        try:
            if httpx.get(f"{url}/health/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"never ready in {timeout_s:g} s:\n" + "".join(r.text()[-3000:] for r in ranks))


def launch_by_hand(model: Path, cache_dir: Path, per_rank: list[list[str]]) -> tuple[list[Rank], str]:
    """Ranks started one by one (no launcher to kill the others when one dies); (ranks, rank 0's URL)."""
    hostfile = cache_dir / "hosts.json"
    cache_dir.mkdir(parents=True, exist_ok=True)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in per_rank]))
    port = free_port()
    ranks = []
    for rank, extra in enumerate(per_rank):
        env = {**user_environ(), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "SEMANTIC_CACHE_DIR": str(cache_dir),
               "SEMANTIC_PORT": str(port), "SEMANTIC_LOG_JSON": "true", "SEMANTIC_POOL_BUDGET_MB": "64"}
        argv = [str(VENV_BIN / "semantic"), "--serve", "--model", str(model), *extra]
        process = subprocess.Popen(argv, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
        ranks.append(Rank(rank, process))
    for r in ranks:
        r.start_reading()
    return ranks, f"http://127.0.0.1:{port}"
