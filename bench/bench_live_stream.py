"""What slow live-stream clients cost the engine: decode throughput with no ``GET /v1/stream`` client vs with 50
clients that read a few bytes and sleep.

One ``semantic --serve`` on the model serves the whole run. Phases alternate
(none, slow, slow, none, none, slow, ...) so drift on a shared machine hits both
alike. Each phase: the slow clients connect (loopback; each reads
``--read-bytes`` then sleeps ``--sleep-s``, with a small receive window, so the
server's writes to it soon block and it drops snapshots), one discarded round
that prefills every agent's prompt, then measured rounds in which each agent
repeats its turn and reuses its cached prompt: decode-bound, the work the
stream's publisher competes with. Before the rounds, the phase waits until the
server drops stats frames for the clients (their buffers are full), so the
rounds run beside clients that have fallen behind. On loopback Linux
autotunes each connection's kernel send buffer to 4 MiB (tcp_wmem's max),
which holds what a client has not read before the server's own buffer fills:
at the default 0.1 s interval (the fastest the endpoint allows, the most work
for its publisher) that takes about two minutes a phase. The target: no change in the engine's decode
rate (within the run-to-run noise of the phases without clients).

Per round: N concurrent streaming chat completions (greedy, distinct
session_ids); aggregate tok/s = completion tokens of all streams / wall time
from the first request sent to the last stream done, measured by the client.
Server CPU per round (all threads, and the main thread, which runs the asyncio
loop and so the stream's publisher and writers) comes from the server process.
After each phase with clients, /metrics says how many were connected and what
the server dropped for them.

Run: ``python -m bench.bench_live_stream [--quick] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import re
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil
from bench.bench_ui_overhead import RoundResult, Workload, run_round
from bench.bench_vs_mlx_lm_server import model_folder
from bench.common import base_parser, print_table
from bench.results import BenchResult, Series, recorded
from bench.served import Batching, running, semantic_launch

CONNECT_TIMEOUT_S = 30.0
RECEIVE_WINDOW = 8192  # bytes the kernel holds for a slow client before the server's writes to it block


@dataclass(frozen=True, slots=True)
class SlowClients:
    count: int
    read_bytes: int
    sleep_s: float
    interval_s: float
    fill_s: float  # the longest wait for the server to start dropping their frames


@dataclass(slots=True)
class PhaseResult:
    mode: str  # "none" or "slow"
    rounds: list[RoundResult]
    stream: dict[str, float] = field(default_factory=dict)  # /metrics after the phase (slow phases)

    @property
    def tok_s(self) -> float:
        return statistics.median(r.tok_s for r in self.rounds)

    def mean(self, name: str) -> float:
        return statistics.fmean(getattr(r, name) for r in self.rounds)

    def row(self, index: int) -> list[object]:
        rates = [r.tok_s for r in self.rounds]
        return [index, self.mode, self.tok_s, min(rates), max(rates), round(self.mean("tokens")),
                self.mean("cpu_s"), self.mean("main_cpu_s"), f"{self.mean('main_share'):.1%}",
                int(self.stream.get("clients", 0)), int(self.stream.get("dropped_in_rounds", 0)),
                int(self.stream.get("stats_dropped", 0)), int(self.stream.get("stats_built", 0))]


# -- the slow clients -------------------------------------------------------------------------------


async def slow_client(url: str, clients: SlowClients, connected: asyncio.Event, counter: list[int]) -> None:
    """One dashboard that has stopped keeping up: a few bytes, a long sleep, again."""
    address = urlparse(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_WINDOW)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (address.hostname, address.port))
    # A small limit: the reader stops taking bytes off the socket once it holds twice that, unread (4 KiB:
    # room for the response head).
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    query = f"/v1/stream?interval={clients.interval_s}"
    writer.write(f"GET {query} HTTP/1.1\r\nHost: {address.netloc}\r\n\r\n".encode())
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"the stream was refused: {head[:200]!r}")
        counter[0] += 1
        if counter[0] == clients.count:
            connected.set()
        while True:
            await reader.read(clients.read_bytes)
            await asyncio.sleep(clients.sleep_s)
    finally:
        writer.close()


async def _phase(url: str, workload: Workload, clients: SlowClients | None, server: psutil.Process) -> PhaseResult:
    tasks: list[asyncio.Task] = []
    if clients is not None:
        connected, counter = asyncio.Event(), [0]
        tasks = [asyncio.create_task(slow_client(url, clients, connected, counter)) for _ in range(clients.count)]
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            await connected.wait()
    try:
        if clients is not None:
            await asyncio.to_thread(wait_dropping, url, clients)
        before = await asyncio.to_thread(stream_metrics, url)
        await asyncio.to_thread(run_round, url, workload, server)  # prefills every agent's prompt
        rounds = [await asyncio.to_thread(run_round, url, workload, server) for _ in range(workload.rounds)]
        stream = await asyncio.to_thread(stream_metrics, url)
        stream["dropped_in_rounds"] = stream["stats_dropped"] - before["stats_dropped"]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(wait_no_clients, url)
    return PhaseResult("slow" if clients is not None else "none", rounds, stream)


def stream_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text

    def value(pattern: str) -> float:
        found = re.search(pattern + r" ([0-9.e+]+)", text)
        return float(found.group(1)) if found else float("nan")

    return {"clients": value(r"semantic_stream_clients"),
            "stats_dropped": value(r'semantic_stream_dropped_frames_total\{kind="stats"\}'),
            "log_dropped": value(r'semantic_stream_dropped_frames_total\{kind="log"\}'),
            "stats_built": value(r"semantic_stream_stats_frames_built_total")}


def wait_dropping(url: str, clients: SlowClients) -> None:
    """Until the server drops stats frames for the slow clients (their socket buffers and uvicorn's are full),
    so the rounds measure the engine beside clients that have fallen behind, not ones still being absorbed."""
    start = stream_metrics(url)["stats_dropped"]
    deadline = time.monotonic() + clients.fill_s
    while stream_metrics(url)["stats_dropped"] - start < clients.count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the slow clients fell no frames behind in {clients.fill_s:.0f} s: they read too "
                               "fast to be slow (lower --read-bytes or raise --fill-s)")
        time.sleep(0.5)


def wait_no_clients(url: str, timeout_s: float = 30.0) -> None:
    """The server forgets the slow clients before the next phase measures without them."""
    deadline = time.monotonic() + timeout_s
    while stream_metrics(url)["clients"] != 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the server still counts live stream clients after they closed")
        time.sleep(0.2)


# -- report -------------------------------------------------------------------------------------------

HEADERS = ["phase", "clients", "tok/s med", "min", "max", "tokens/round", "CPU s/round", "main thread CPU s",
           "main % core", "stream clients", "stats dropped in rounds", "stats dropped (total)", "stats built (total)"]


def summarize(phases: list[PhaseResult], result: BenchResult) -> None:
    print("\n## Aggregate generated tok/s per phase (median of its rounds)")
    print_table(HEADERS, [p.row(i + 1) for i, p in enumerate(phases)])
    none = [p for p in phases if p.mode == "none"]
    slow = [p for p in phases if p.mode == "slow"]
    base, loaded = statistics.median(p.tok_s for p in none), statistics.median(p.tok_s for p in slow)
    pairs = list(zip(phases[::2], phases[1::2]))
    rows = []
    for i, (a, b) in enumerate(pairs):
        quiet, busy = (a, b) if a.mode == "none" else (b, a)
        rows.append([f"pair {i + 1}", quiet.tok_s, busy.tok_s, f"{busy.tok_s / quiet.tok_s - 1:+.1%}"])
    rows.append(["median", base, loaded, f"{loaded / base - 1:+.1%}"])
    print("\n## With 50 slow clients against none (change in decode tok/s)")
    print_table(["", "no clients tok/s", "slow clients tok/s", "change"], rows)
    group = "aggregate decode tok/s (median over phases)"
    result.metric(group, "no stream clients", base, "tok/s")
    result.metric(group, "slow stream clients", loaded, "tok/s")
    result.metric(group, "change with slow clients", 100 * (loaded / base - 1), "%", "neither")
    spread = [p.tok_s for p in none]
    result.metric(group, "spread of the phases without clients (max/min - 1)", 100 * (max(spread) / min(spread) - 1),
                  "%", "neither")
    for mode, mine in (("none", none), ("slow", slow)):
        group = f"server CPU per round: {mode}"
        result.metric(group, "all threads", statistics.fmean(p.mean("cpu_s") for p in mine), "s", "lower")
        result.metric(group, "main thread (event loop)", statistics.fmean(p.mean("main_cpu_s") for p in mine),
                      "s", "lower")
    last = slow[-1].stream
    result.metric("stream (server /metrics at the last slow phase)", "clients connected", last["clients"], "",
                  "neither")
    result.metric("stream (server /metrics at the last slow phase)", "stats frames dropped, total",
                  last["stats_dropped"], "", "neither")
    result.metric("stream (server /metrics at the last slow phase)", "stats frames dropped during its rounds",
                  last["dropped_in_rounds"], "", "neither")
    result.metric("stream (server /metrics at the last slow phase)", "stats frames built, total",
                  last["stats_built"], "", "neither")
    result.series.append(Series("decode tok/s: no stream clients vs 50 slow ones", "pair", "aggregate tok/s",
                                list(range(1, len(pairs) + 1)),
                                {"none": [r[1] for r in rows[:-1]], "slow": [r[2] for r in rows[:-1]]}, "bar"))


def phase_order(pairs: int) -> list[str]:
    """none, slow, slow, none, none, slow, ...: each mode runs first in half the pairs."""
    order: list[str] = []
    for i in range(pairs):
        order += ["none", "slow"] if i % 2 == 0 else ["slow", "none"]
    return order


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4, help="concurrent generating agents (default: 4)")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per turn (default: 64)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per phase (default: 3)")
    parser.add_argument("--pairs", type=int, default=3, help="phase pairs, order alternating (default: 3)")
    parser.add_argument("--clients", type=int, default=50, help="slow stream clients (default: 50)")
    parser.add_argument("--interval", type=float, default=0.1,
                        help="their stats interval, s (default: 0.1, the fastest the stream allows)")
    parser.add_argument("--read-bytes", type=int, default=256, help="bytes a slow client reads at a time")
    parser.add_argument("--sleep-s", type=float, default=1.0, help="its sleep between reads (default: 1)")
    parser.add_argument("--fill-s", type=float, default=300.0,
                        help="longest wait, before measuring, for the server to drop frames for every slow client "
                             "on average (their buffers full; default: 300)")
    args = parser.parse_args()
    workload = Workload(args.agents, 32 if args.quick else args.tokens, 1 if args.quick else args.rounds)
    pairs = 1 if args.quick else args.pairs
    clients = SlowClients(args.clients, args.read_bytes, args.sleep_s, args.interval, args.fill_s)
    folder = model_folder(args.model, args.cache_dir)
    print(f"# {workload}, {clients}, {pairs} pair(s), cpus={psutil.cpu_count()}")
    result = BenchResult("bench_live_stream", "Live stream: decode rate with 50 slow GET /v1/stream clients vs none",
                         {"model": args.model, "quick": args.quick, "agents": workload.agents,
                          "max_tokens": workload.max_tokens, "rounds": workload.rounds, "pairs": pairs,
                          "clients": clients.count, "interval_s": clients.interval_s,
                          "read_bytes": clients.read_bytes, "sleep_s": clients.sleep_s, "pool_mb": args.pool_mb})
    started = time.perf_counter()
    with recorded(result, args.json), tempfile.TemporaryDirectory(prefix="bench-live-stream-") as work:
        launch = semantic_launch(folder, Path(work) / "state", args.pool_mb, Batching())
        with running(launch, Path(work)) as server:
            process = psutil.Process(server.process.pid)
            phases = []
            for mode in phase_order(pairs):
                phase = asyncio.run(_phase(server.url, workload, clients if mode == "slow" else None, process))
                phases.append(phase)
                print(f"# {mode}: {phase.tok_s:.1f} tok/s ({[round(r.tok_s, 1) for r in phase.rounds]})"
                      + (f", stream {phase.stream}" if mode == "slow" else ""), flush=True)
        summarize(phases, result)
    print(f"# finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
