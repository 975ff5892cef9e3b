"""The first answer of a fresh server against its second: TTFT of two same-length prompts right after ready.

    python -m bench.bench_first_answer [--model smollm2-135m] [--repeats 3] [--fresh-compile] [--json PATH]

Each repeat starts ``semantic --serve`` anew, waits for ``/health/ready``
(no warm-up request: what a user's first request meets), then sends two
chat completions of the same length from two new agents (so both prefill
their whole prompt), one after the other, streaming, and times each to its
first token. ``--fresh-compile`` points numba's cache at an empty folder
for every start, as on a fresh clone's first run (the compiled CPU loops
are built then, not loaded). The target (issue 53): the first within 1.5x of
the second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_vs_mlx_lm_server import model_folder
from bench.common import base_parser
from bench.results import BenchResult, recorded
from bench.served import READY_TIMEOUT_S, free_port, semantic_launch, Batching, server_env, stop

PROMPTS = ("Name three rivers of Europe and say which is longest, in one short sentence please.",
           "Name three mountains of Asia and say which is highest, in one short sentence please.")


def ttft(client: httpx.Client, prompt: str, agent: str) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt's tokens as the server counted them."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "session_id": agent}
    started, first, prompt_tokens = time.perf_counter(), None, 0
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content") and first is None:
                    first = time.perf_counter()
    return (first or time.perf_counter()) - started, prompt_tokens


def one_start(args: argparse.Namespace, folder: Path, work: Path, repeat: int) -> tuple[float, float, int, float]:
    launch = semantic_launch(folder, work / f"state{repeat}", args.pool_mb, Batching())
    env = server_env()
    if args.fresh_compile:
        env["NUMBA_CACHE_DIR"] = str(work / f"numba{repeat}")
    port = free_port()
    log = open(work / f"semantic-{repeat}.log", "wb")
    started = time.perf_counter()
    process = subprocess.Popen([*launch.argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env,
                               cwd=Path(__file__).resolve().parent.parent)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=READY_TIMEOUT_S) as client:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"semantic exited with {process.returncode}; see {log.name}")
                try:
                    if client.get("/health/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.perf_counter() - started > READY_TIMEOUT_S:
                    raise TimeoutError("semantic not ready")
                time.sleep(0.05)
            ready_s = time.perf_counter() - started
            first, tokens = ttft(client, PROMPTS[0], f"first-{repeat}")
            second, _ = ttft(client, PROMPTS[1], f"second-{repeat}")
    finally:
        stop(process)
        log.close()
    return first, second, tokens, ready_s


def run(args: argparse.Namespace, result: BenchResult) -> None:
    firsts, seconds = [], []
    folder = model_folder(args.model, args.cache_dir)  # (imported once, outside the timed starts)
    with tempfile.TemporaryDirectory(prefix="bench-first-") as work:
        for repeat in range(args.repeats):
            first, second, tokens, ready_s = one_start(args, folder, Path(work), repeat)
            firsts.append(first)
            seconds.append(second)
            print(f"# start {repeat + 1}: ready after {ready_s:.2f} s; first answer TTFT {first:.3f} s, "
                  f"second {second:.3f} s ({tokens}-token prompts), x{first / second:.2f}", flush=True)
    ratios = [f / s for f, s in zip(firsts, seconds)]
    result.metric("semantic", "first request TTFT (median)", statistics.median(firsts), "s", better="lower")
    result.metric("semantic", "second request TTFT (median)", statistics.median(seconds), "s", better="lower")
    result.metric("semantic", "first / second (median)", statistics.median(ratios), "x", better="lower", target=1.5)
    result.notes.append("fresh numba cache each start (a fresh clone's first run)" if args.fresh_compile
                        else "numba's cache as the install left it")
    print(f"first / second: median x{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = base_parser(__doc__.splitlines()[0])
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--repeats", type=int, default=3, help="fresh starts (default 3)")
    parser.add_argument("--fresh-compile", action="store_true",
                        help="an empty numba cache for every start, as on a fresh clone's first run")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = BenchResult("bench_first_answer", "The first answer of a fresh semantic server against its second",
                         args={"model": str(args.model), "repeats": args.repeats, "fresh_compile": args.fresh_compile})
    with recorded(result, args.json) as result:
        run(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
