"""What the workbench UI costs the engine: throughput with the TUI attached vs headless ``--serve``.

The same HTTP workload runs against ``semantic --serve`` and against the API
inside the real workbench, live in a 160x48 tmux pane (every panel renders and
refreshes; one chat pane watches a bench agent, so its tokens stream into the
UI too). Phases alternate (serve, tui, serve, tui, ...) so drift on a shared
machine hits both alike. Each phase: the warm-up completion every server gets,
one discarded round that prefills every agent's prompt, then measured rounds in
which each agent repeats its turn and reuses its cached prompt: decode-bound,
the work a UI refresh competes with. The target: the UI costs under 5%.

Per round: N concurrent streaming chat completions (greedy, distinct
session_ids); aggregate tok/s = completion tokens of all streams / wall time
from the first request sent to the last stream done, measured by the client.
CPU seconds per round come from the server process: all threads, and its main
thread alone, which runs the asyncio loop (HTTP in both modes, plus Textual in
the workbench): the difference between modes is what the UI costs.

Run: ``python -m bench.bench_ui_overhead [--quick] [--json PATH]`` (needs tmux).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil
from bench.chat_stream import ChatClient
from bench.common import ROOT, base_parser, print_table
from bench.results import BenchResult, Series, recorded
from bench.served import WARMUP_MESSAGES, Launch, server_env, serving
from bench.bench_vs_mlx_lm_server import model_folder

from tests.support.terminal import (
    TmuxTerminal,
    isolated_env,
    semantic_command,
    tmux_available,
    wait_until_ready,
)

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0
WATCH_TIMEOUT_S = 30.0
TOPICS = ("the ocean", "mountains", "a city at night", "a robot", "autumn", "a library", "trains", "the moon",
          "coffee", "a garden", "rain", "a lighthouse", "chess", "bees", "a desert", "snow")


@dataclass(frozen=True, slots=True)
class Workload:
    agents: int
    max_tokens: int
    rounds: int

    def session(self, agent: int) -> str:
        return f"ui-bench-{agent}"

    def messages(self, agent: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Write a long story about {TOPICS[agent % len(TOPICS)]}."}]


@dataclass(frozen=True, slots=True)
class RoundResult:
    tokens: int
    wall_s: float
    ttft_s: float  # median over the round's streams
    cpu_s: float  # the server process, all threads
    main_cpu_s: float  # its main thread: the event loop (HTTP, and Textual in the workbench)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def main_share(self) -> float:
        """How much of one core the main thread kept busy: what the UI adds shows here first."""
        return self.main_cpu_s / self.wall_s


@dataclass(frozen=True, slots=True)
class PhaseResult:
    mode: str
    rounds: list[RoundResult]

    @property
    def tok_s(self) -> float:
        return statistics.median(r.tok_s for r in self.rounds)

    def mean(self, field: str) -> float:
        return statistics.fmean(getattr(r, field) for r in self.rounds)

    def row(self, index: int) -> list[object]:
        rates = [r.tok_s for r in self.rounds]
        return [index, self.mode, self.tok_s, min(rates), max(rates), round(self.mean("tokens")),
                self.mean("ttft_s"), self.mean("cpu_s"), self.mean("main_cpu_s"), f"{self.mean('main_share'):.1%}"]


# -- the workload ---------------------------------------------------------------------------------


async def _round(url: str, workload: Workload) -> tuple[int, float, float]:
    async with ChatClient(url, sends_session_id=True) as client:
        turns = await asyncio.gather(*(
            client.turn(workload.session(i), i, workload.messages(i), workload.max_tokens)
            for i in range(workload.agents)))
    wall = max(t.done_at for t in turns) - min(t.sent_at for t in turns)
    return sum(t.completion_tokens for t in turns), wall, statistics.median(t.ttft_s for t in turns)


def run_round(url: str, workload: Workload, server: psutil.Process) -> RoundResult:
    before = _cpu(server)
    tokens, wall, ttft = asyncio.run(_round(url, workload))
    after = _cpu(server)
    return RoundResult(tokens, wall, ttft, after[0] - before[0], after[1] - before[1])


def _cpu(process: psutil.Process) -> tuple[float, float]:
    """(all threads, main thread) CPU seconds so far; the main thread's id is the process id on Linux."""
    times = process.cpu_times()
    main = next((t for t in process.threads() if t.id == process.pid), None)
    return times.user + times.system, (main.user_time + main.system_time) if main else float("nan")


def measure(mode: str, url: str, workload: Workload,
            after_warmup: Callable[[], None] = lambda: None) -> PhaseResult:
    server = _listening_process(url)
    run_round(url, workload, server)  # prefills every agent's prompt; later rounds reuse it
    after_warmup()
    return PhaseResult(mode, [run_round(url, workload, server) for _ in range(workload.rounds)])


def _listening_process(url: str) -> psutil.Process:
    port = urlparse(url).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise RuntimeError(f"no process listens on {url}")


# -- the two modes ----------------------------------------------------------------------------------


def common_flags(folder: Path, state_dir: Path, pool_mb: float) -> list[str]:
    # No persisting on exit: the state dir is thrown away, and a stop that writes caches only slows the run.
    return ["--model", str(folder), "--cache-dir", str(state_dir), "--pool-budget-mb", f"{pool_mb:g}",
            "--no-persist-on-exit"]


@contextmanager
def headless(flags: list[str], log_dir: Path) -> Iterator[str]:
    argv = (*semantic_command(), "--serve", *flags)
    launch = Launch("semantic-serve", argv, "/health/ready", sends_session_id=True)
    with serving(launch, log_dir) as url:
        yield url


@contextmanager
def workbench(flags: list[str], work_dir: Path) -> Iterator[tuple[str, TmuxTerminal]]:
    """The workbench in tmux, warmed up like ``serving`` warms up ``--serve``; quit with ctrl+q."""
    env = isolated_env(work_dir / "home", server_env())
    with TmuxTerminal(work_dir / "tty", 160, 48) as terminal:
        terminal.start([*semantic_command(), *flags, "--port", "0"], env, cwd=ROOT)
        url = wait_until_ready(terminal, READY_TIMEOUT_S)
        body = {"messages": WARMUP_MESSAGES, "max_tokens": 4, "temperature": 0, "session_id": "warmup"}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=READY_TIMEOUT_S).raise_for_status()
        yield url, terminal
        # ctrl+q: the app's quit wherever the focus is (q alone would be typed into a chat input).
        terminal.press("C-q")
        terminal.wait_exit(STOP_TIMEOUT_S)


def watch_one_agent(terminal: TmuxTerminal) -> None:
    """Open a chat pane on the table's second row: the first is the warm-up agent, the rest are bench agents."""
    terminal.press("Down", "c")
    pattern = r"OpenAI session ui-bench-\d+ · watching"
    terminal.wait_for_text(pattern, "a chat pane watching a bench agent", WATCH_TIMEOUT_S)


def run_phase(mode: str, folder: Path, work: Path, pool_mb: float, workload: Workload, watch: bool) -> PhaseResult:
    state = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work))
    flags = common_flags(folder, state / "cache", pool_mb)
    if mode == "serve":
        with headless(flags, state) as url:
            return measure(mode, url, workload)
    with workbench(flags, state) as (url, terminal), terminal.dump_on_failure():
        hook = (lambda: watch_one_agent(terminal)) if watch else (lambda: None)
        return measure(mode, url, workload, hook)


# -- report -----------------------------------------------------------------------------------------

HEADERS = ["run", "mode", "tok/s med", "min", "max", "tokens/round", "TTFT s", "CPU s/round", "main thread CPU s",
           "main thread % core"]


def summarize(phases: list[PhaseResult], result: BenchResult) -> None:
    print("\n## Aggregate generated tok/s per phase (median of its rounds)")
    print_table(HEADERS, [p.row(i + 1) for i, p in enumerate(phases)])
    serve = statistics.median(p.tok_s for p in phases if p.mode == "serve")
    tui = statistics.median(p.tok_s for p in phases if p.mode == "tui")
    pairs = [(a, b) for a, b in zip(phases[::2], phases[1::2])]
    print("\n## UI overhead (1 - tui / serve; target < 5%)")
    rows = [[f"pair {i + 1}", a.tok_s, b.tok_s, f"{1 - b.tok_s / a.tok_s:+.1%}"] for i, (a, b) in enumerate(pairs)]
    rows.append(["median", serve, tui, f"{1 - tui / serve:+.1%}"])
    print_table(["", "serve tok/s", "tui tok/s", "overhead"], rows)
    record(result, phases, pairs, serve, tui)


def record(result: BenchResult, phases: list[PhaseResult], pairs: list[tuple[PhaseResult, PhaseResult]],
           serve: float, tui: float) -> None:
    group = "aggregate generated tok/s (median over phases)"
    result.metric(group, "semantic --serve (headless)", serve, "tok/s")
    result.metric(group, "workbench (TUI attached)", tui, "tok/s")
    result.metric(group, "UI overhead (1 - tui / serve)", 100 * (1 - tui / serve), "%", "lower", target=5.0)
    for i, (a, b) in enumerate(pairs):
        result.metric("UI overhead per serve/tui pair", f"pair {i + 1}", 100 * (1 - b.tok_s / a.tok_s), "%", "lower")
    for mode in ("serve", "tui"):
        mine = [p for p in phases if p.mode == mode]
        group = f"server CPU per round: {mode}"
        result.metric(group, "all threads", statistics.fmean(p.mean("cpu_s") for p in mine), "s", "lower")
        result.metric(group, "main thread (event loop)", statistics.fmean(p.mean("main_cpu_s") for p in mine),
                      "s", "lower")
        result.metric(group, "main thread share of a core",
                      100 * statistics.fmean(p.mean("main_share") for p in mine), "%", "lower")
    result.series.append(Series("decode tok/s: headless vs workbench", "serve/tui pair", "aggregate tok/s",
                                list(range(1, len(pairs) + 1)),
                                {"--serve": [a.tok_s for a, _ in pairs], "workbench": [b.tok_s for _, b in pairs]},
                                "bar"))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8, help="concurrent streams per round (default: 8)")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per stream (default: 64)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per phase (default: 3)")
    parser.add_argument("--pairs", type=int, default=2, help="serve+tui phase pairs, alternating (default: 2)")
    parser.add_argument("--no-watch", dest="watch", action="store_false", help="no chat pane watching an agent")
    args = parser.parse_args()
    if not tmux_available():
        raise SystemExit("needs tmux: apt-get install tmux")
    workload = Workload(args.agents, 32 if args.quick else args.tokens, 2 if args.quick else args.rounds)
    pairs = 1 if args.quick else args.pairs
    folder = model_folder(args.model, args.cache_dir)
    print(f"# model folder {folder}\n# {workload}, {pairs} pair(s), watch={args.watch}, cpus={psutil.cpu_count()}")
    result = BenchResult("bench_ui_overhead", "Workbench UI cost: TUI attached vs headless --serve",
                         {"model": args.model, "quick": args.quick, "agents": workload.agents,
                          "max_tokens": workload.max_tokens, "rounds": workload.rounds, "pairs": pairs,
                          "watch": args.watch, "pool_mb": args.pool_mb})
    started = time.perf_counter()
    with recorded(result, args.json):
        phases: list[PhaseResult] = []
        with tempfile.TemporaryDirectory(prefix="bench-ui-overhead-") as work:
            for mode in ("serve", "tui") * pairs:
                phases.append(run_phase(mode, folder, Path(work), args.pool_mb, workload, args.watch))
                print(f"# {mode}: {phases[-1].tok_s:.1f} tok/s ({[round(r.tok_s, 1) for r in phases[-1].rounds]})")
        summarize(phases, result)
    print(f"# finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
