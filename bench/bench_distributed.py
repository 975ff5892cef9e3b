"""One model on several ranks (mlx.launch, ring backend) against the same model in one process.

Both sides run the same server (`semantic --serve`) on the same random-weight
model folder and the same workload, alternating which goes first: N agents
created together, one warm-up turn each, then a measured turn where all N
generate ``--tokens`` greedy tokens at once. Reported per side: aggregate
decode tok/s over the measured turn (wall clock, first request sent to last
reply), TTFT median (server-reported), and seconds from launch to ready.

The ranks run on this one machine, so they share its cores and talk over
loopback TCP: this measures what the lockstep costs here, not what two Macs
gain. Reproduce a rank run by hand with:

    mlx.launch --backend ring -n 2 -- semantic --serve --model FOLDER

``--by-hand`` adds a third side: the same ranks started without the launcher
(``MLX_RANK`` and ``MLX_HOSTFILE`` set per process, as the README shows).
``mlx.launch`` relays the ranks' output in a loop that does not sleep, which
on a small machine takes a core from the ranks; this side shows what that costs.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from bench.common import base_parser, print_table
from bench.random_model import tokenizer_folder, write_random_model
from bench.results import BenchResult, recorded

from tests.support.distributed_run import create_agents, launch, launch_by_hand, wait_ranks_ready

SHAPES = ("llama-tiny", "llama-3.2-1b")


BY_HAND = "by hand"


@contextmanager
def served(model: Path, work: Path, ranks: int, how: str) -> Iterator[str]:
    """A running server's URL: one process or ``mlx.launch`` ranks (``how`` == ""), or ranks started by hand."""
    if how != BY_HAND:
        run = launch(model, work, ranks, "--pool-budget-mb", "512")
        try:
            run.wait_ready(timeout_s=900)
            yield run.url
        finally:
            run.stop(timeout_s=300)
        return
    started, url = launch_by_hand(model, work, [["--pool-budget-mb", "512"]] * ranks)
    try:
        wait_ranks_ready(started, url, timeout_s=900)
        yield url
    finally:
        for r in started:
            r.process.send_signal(signal.SIGINT)
        for r in started:
            try:
                r.process.wait(timeout=300)
            except subprocess.TimeoutExpired:
                r.process.kill()


def measure(model: Path, ranks: int, agents: int, tokens: int, work: Path, how: str = "") -> dict[str, float]:
    """One launch: ready time, then a warm-up and a measured concurrent turn for ``agents`` agents."""
    started = time.perf_counter()
    with served(model, work, ranks, how) as url:
        ready_s = time.perf_counter() - started
        names = [f"bench-{i}" for i in range(agents)]
        create_agents(url, names)
        turn(url, names, "Write a short story about a lighthouse keeper.", tokens)  # warm-up (and compile)
        t0 = time.perf_counter()
        replies = turn(url, names, "Go on with the story.", tokens)
        wall = time.perf_counter() - t0
    generated = sum(r["usage"]["generated_tokens"] for r in replies)
    return {"ready_s": ready_s, "tok_s": generated / wall,
            "ttft_s": statistics.median(r["usage"]["ttft_s"] for r in replies)}


def turn(url: str, names: list[str], content: str, tokens: int) -> list[dict]:
    def one(name: str) -> dict:
        response = httpx.post(f"{url}/v1/agents/{name}/messages", timeout=1800,
                              json={"content": content, "max_tokens": tokens, "temperature": 0})
        response.raise_for_status()
        return response.json()

    with ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(one, names))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b", help="random-weight model shape")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the sharded side (default 2)")
    parser.add_argument("--agents", default="1,4", help="concurrent agents per measurement (default 1,4)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per agent per turn (default 32)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating pairs per concurrency (default 2)")
    parser.add_argument("--by-hand", action="store_true",
                        help="also run the ranks started by hand, without mlx.launch (what its output relay costs)")
    args = parser.parse_args()
    agent_counts = [1] if args.quick else [int(n) for n in args.agents.split(",")]
    tokens, repeats = (8, 1) if args.quick else (args.tokens, args.repeats)
    result = BenchResult("bench_distributed", f"{args.ranks} ranks (ring backend, one machine) vs 1 process",
                         {"shape": args.shape, "ranks": args.ranks, "agents": agent_counts, "tokens": tokens,
                          "repeats": repeats})
    with recorded(result, args.json), tempfile.TemporaryDirectory(prefix="semantic-bench-ranks-") as tmp:
        work = Path(tmp)
        model = write_random_model(args.shape, work / args.shape, tokenizer_folder("smollm2-135m", args.cache_dir),
                                   "float32", 0)
        rows = []
        # Sides: (ranks, how they start, label); rotated each repeat so none always goes first.
        sides = [(1, "", "1 process"), (args.ranks, "", f"{args.ranks} ranks")]
        if args.by_hand:
            sides.append((args.ranks, BY_HAND, f"{args.ranks} ranks, by hand"))
        for agents in agent_counts:
            got: dict[str, list[dict[str, float]]] = {label: [] for _, _, label in sides}
            for repeat in range(repeats):
                shift = repeat % len(sides)
                for ranks, how, label in sides[shift:] + sides[:shift]:
                    one = measure(model, ranks, agents, tokens, work / f"cache-{agents}-{repeat}-{len(got[label])}-"
                                  f"{ranks}{'h' if how else ''}", how)
                    got[label].append(one)
                    print(f"# {agents} agents, {label}, repeat {repeat + 1}: {one['tok_s']:.2f} tok/s, "
                          f"TTFT {one['ttft_s']:.2f} s, ready in {one['ready_s']:.1f} s", flush=True)
            group = f"{agents} agent(s) x {tokens} tokens"
            for _, _, label in sides:
                med = {k: statistics.median(m[k] for m in got[label]) for k in ("tok_s", "ttft_s", "ready_s")}
                result.metric(group, f"{label}: aggregate decode", med["tok_s"], "tok/s")
                result.metric(group, f"{label}: TTFT median", med["ttft_s"], "s", better="lower")
                result.metric(group, f"{label}: launch to ready", med["ready_s"], "s", better="lower")
                rows.append([group, label, med["tok_s"], med["ttft_s"], med["ready_s"]])
            for _, how, label in sides[1:]:
                ratios = [s["tok_s"] / o["tok_s"] for s, o in zip(got[label], got["1 process"], strict=True)]
                name = f"{label} / 1 process, decode (median of pairs)"
                if not how:  # the plain ratio keeps the metric name reports compare on
                    name = f"{args.ranks} ranks / 1 process, decode (median of pairs)"
                result.metric(group, name, statistics.median(ratios), "x")
                rows.append([group, f"ratio, {label}", statistics.median(ratios), "", ""])
        result.notes.append(f"Ranks ran on one machine over loopback ({args.ranks} processes sharing its cores); "
                            f"reproduce with: mlx.launch --backend ring -n {args.ranks} -- semantic --serve "
                            f"--model FOLDER (FOLDER: bench/random_model.py --shape {args.shape})")
        print(f"\n## {args.shape}, {args.ranks} ranks vs 1 process, {tokens} greedy tokens per agent")
        print_table(["workload", "side", "decode tok/s", "TTFT s", "ready s"], rows)


if __name__ == "__main__":
    main()
