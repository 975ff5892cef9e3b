"""The benchmarked servers as subprocesses: one at a time, each on a free port, both with OpenBLAS.

Both servers get the same environment, so neither runs on MLX's bundled
reference BLAS (about 30x slower matmul) while the other has OpenBLAS:
semantic would re-execute itself with it, mlx_lm.server would not.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.platform import detect_backend, find_openblas, openblas_preloaded
from engine.platform.openblas import Backend

# A model import or a cold load on a busy 2-core box can take minutes.
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
# A few hundred tokens, so each server's first real prefill does not also pay for growing its buffers.
WARMUP_TEXT = "Summarise: " + " ".join(f"item {i} is {i * 7 % 101}." for i in range(50))
WARMUP_MESSAGES = [{"role": "user", "content": WARMUP_TEXT}]


@dataclass(frozen=True, slots=True)
class Batching:
    """The knobs both servers expose under different names, set equal on both."""

    decode: int = 16  # semantic --max-batch-size, mlx_lm.server --decode-concurrency
    prefill: int = 4  # mlx_lm.server --prompt-concurrency (semantic prefills together what fits one chunk of
    # --prefill-step-size tokens; it has no setting of its own for this)
    prefill_step: int = 512  # --prefill-step-size on both


@dataclass(frozen=True, slots=True)
class Launch:
    """How to start one server; everything but the port."""

    name: str
    argv: tuple[str, ...]
    # A GET that answers 200 once the model is loaded; None: only the warm-up completion tells.
    ready_path: str | None
    # semantic's extension: the body's session_id names the agent whose KV cache a turn reuses.
    sends_session_id: bool
    # Where the server keeps state across restarts (semantic's disk tier); emptied before every start
    # so that no run inherits the caches of the one before.
    state_dir: Path | None = None
    # The body's model field, for a server that requires one (mlx_vlm.server); None: not sent.
    model_field: str | None = None
    # Environment the server is started with, beyond the bench's own (a setting only read from there).
    env: tuple[tuple[str, str], ...] = ()
    # Each turn's messages sent as one raw prompt to /v1/completions (a base model's endpoint), not as a chat.
    raw_prompts: bool = False

    def flags(self) -> str:
        return " ".join(self.argv[3:])


def semantic_launch(folder: Path, state_dir: Path, pool_mb: float, batching: Batching, persist: bool = False,
                    flags: tuple[str, ...] = ()) -> Launch:
    """``persist``: write every hot agent to the disk tier on SIGTERM, as a user's server does, so a restart
    resumes them; off where the state dir is thrown away after the run and the write would only slow the stop.
    ``flags``: more of semantic's own flags (a setting the run compares)."""
    argv = (
        sys.executable, "-m", "semantic_cli", "--serve", "--model", str(folder), "--cache-dir", str(state_dir),
        "--pool-budget-mb", f"{pool_mb:.3f}", "--max-batch-size", str(batching.decode),
        "--prefill-step-size", str(batching.prefill_step),
        "--persist-on-exit" if persist else "--no-persist-on-exit", "--log-level", "warning", *flags,
    )
    return Launch("semantic", argv, "/health/ready", sends_session_id=True, state_dir=state_dir)


def peer_launch(folder: Path, batching: Batching, cache_entries: int, cache_bytes: int | None = None) -> Launch:
    argv = [
        sys.executable, "-m", "mlx_lm.server", "--model", str(folder),
        "--decode-concurrency", str(batching.decode), "--prompt-concurrency", str(batching.prefill),
        "--prefill-step-size", str(batching.prefill_step), "--prompt-cache-size", str(cache_entries),
        "--log-level", "WARNING",
    ]
    if cache_bytes is not None:
        argv += ["--prompt-cache-bytes", str(cache_bytes)]
    # Its /v1/models scans the Hugging Face hub cache and fails without one, and /health says
    # "ok" while the model is still loading: only a completion proves it is ready.
    return Launch("mlx_lm.server", tuple(argv), None, sends_session_id=False)


def peer_defaults_launch(folder: Path) -> Launch:
    """``mlx_lm.server --model FOLDER`` as users run it: its own batching and its 10-entry prompt cache."""
    argv = (sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--log-level", "WARNING")
    return Launch("mlx_lm.server", argv, None, sends_session_id=False)


def server_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    library = find_openblas()
    if sys.platform == "linux" and detect_backend() is Backend.CPU and library and not openblas_preloaded():
        env["LD_PRELOAD"] = " ".join(filter(None, [env.get("LD_PRELOAD", ""), str(library)]))
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, slots=True)
class Running:
    """A started, warmed-up server."""

    url: str
    process: subprocess.Popen
    log_path: Path


@contextmanager
def running(launch: Launch, log_dir: Path, keep_state: bool = False,
            env_overrides: dict[str, str] | None = None) -> Iterator[Running]:
    """Start ``launch``, wait until it answers a completion, yield it, stop it.

    ``keep_state``: a restart of the same server, which finds what the last run left in its state dir.
    ``env_overrides``: extra environment for the server process (the soak pins BLAS threads and malloc arenas).
    """
    if launch.state_dir is not None and not keep_state:
        shutil.rmtree(launch.state_dir, ignore_errors=True)
    port = free_port()
    log_path = log_dir / f"{launch.name}-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*launch.argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**server_env(), **dict(launch.env), **(env_overrides or {})},
                                   cwd=Path(__file__).resolve().parent.parent)
        peak = PeakRss(process.pid)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(process, launch, url, log_path)
            yield Running(url, process, log_path)
            if launch.sends_session_id:
                print(agent_cache_line(url), flush=True)
        finally:
            peak.close()
            stop(process)
            print(f"#   {launch.name} peak RSS {peak.bytes / 2**20:.0f} MiB", flush=True)


def agent_cache_line(url: str) -> str:
    """What semantic's agents hold at the end of a run, per agent (``/v1/agents``): KV bytes, and for a model
    with recurrent layers the snapshots (checkpoints) and the current state, which a benchmark reports."""
    try:
        agents = httpx.get(f"{url}/v1/agents", timeout=30).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return f"#   semantic agents at the end: not read ({type(exc).__name__}: {exc})"

    def spread(field: str) -> str:
        values = sorted(a.get(field) or 0 for a in agents)
        mib = [v / 2**20 for v in values]
        return f"median {mib[len(mib) // 2]:.1f} MiB (max {mib[-1]:.1f})" if mib else "none"

    line = f"#   semantic agents at the end: {len(agents)}, cache per agent {spread('bytes')}"
    if any(a.get("state_bytes") for a in agents):
        line += f", snapshots per agent {spread('checkpoint_bytes')}, recurrent state per agent {spread('state_bytes')}"
    return line


class PeakRss:
    """The largest resident set a server process (and its children) reached, sampled four times a second:
    the peak memory a benchmark reports beside its timings."""

    def __init__(self, pid: int) -> None:
        self.bytes = 0
        self._pid = pid
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        def rss(process: psutil.Process) -> int:
            try:
                return process.memory_info().rss
            except psutil.Error:
                return 0  # gone between listing and reading

        try:
            process = psutil.Process(self._pid)
            while not self._done.wait(0.25):
                self.bytes = max(self.bytes, sum(rss(p) for p in [process, *process.children(recursive=True)]))
        except psutil.Error:
            return  # the server is gone: the peak so far stands

    def close(self) -> None:
        self._done.set()
        self._thread.join(2)


@contextmanager
def serving(launch: Launch, log_dir: Path, keep_state: bool = False) -> Iterator[str]:
    """``running``, for callers that need only the base URL."""
    with running(launch, log_dir, keep_state) as server:
        yield server.url


def wait_ready(process: subprocess.Popen, launch: Launch, url: str, log_path: Path) -> None:
    """Poll until a small completion succeeds; it also warms both servers up the same way."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(base_url=url, timeout=READY_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{launch.name} exited with {process.returncode}:\n{_tail(log_path)}")
            if _warmed_up(client, launch):
                return
            time.sleep(0.5)
    raise TimeoutError(f"{launch.name} not ready after {READY_TIMEOUT_S:.0f} s; see {log_path}")


def _warmed_up(client: httpx.Client, launch: Launch) -> bool:
    body: dict = {"messages": WARMUP_MESSAGES, "max_tokens": 4, "temperature": 0}
    if launch.model_field is not None:
        body["model"] = launch.model_field
    if launch.sends_session_id:
        body["session_id"] = "warmup"
    try:
        if launch.ready_path and client.get(launch.ready_path).status_code != 200:
            return False
        return client.post("/v1/chat/completions", json=body).status_code == 200
    except httpx.TransportError:
        return False


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(path: Path, n_chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-n_chars:]
