"""Concurrent requests that name no session: do they share the batch?

A script calling the OpenAI SDK from several threads without semantic's
``session_id`` sends requests with the same system prompt (here: none) at
once. semantic names such a request's agent by a hash of its prefix, so all
of them were one agent, served one turn after another; now they take sibling
lanes of that agent (engine/api/agent_lanes.py). ``--requests`` identical
chat completions of ``--tokens`` tokens each, all at once, greedy, against
``semantic --serve`` and ``mlx_lm.server --model FOLDER`` (its defaults), one
server at a time, order alternating: the wall time and when each answer
ended.

Run: ``LD_PRELOAD=... python -m bench.bench_sessionless [--quick] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from bench.bench_vs_mlx_lm_server import model_folder
from bench.chat_stream import ChatClient, Turn
from bench.common import base_parser
from bench.comparison import paired, print_comparisons
from bench.peer_runs import load_average
from bench.results import BenchResult
from bench.served import Batching, peer_defaults_launch, running, semantic_launch

PROMPT = [{"role": "user", "content": "Tell me a short story."}]


async def burst(url: str, requests: int, tokens: int) -> tuple[float, list[Turn]]:
    async with ChatClient(url, sends_session_id=False) as client:
        started = time.perf_counter()
        turns = await asyncio.gather(*(client.turn("same", i, PROMPT, tokens) for i in range(requests)))
        return time.perf_counter() - started, list(turns)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, help="identical requests at once (default: 12; quick 4)")
    parser.add_argument("--tokens", type=int, help="tokens per reply (default: 120; quick 16)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per server (default: 2)")
    args = parser.parse_args()
    requests = args.requests or (4 if args.quick else 12)
    tokens = args.tokens or (16 if args.quick else 120)
    folder = model_folder(args.model, args.cache_dir)
    result = BenchResult("bench_sessionless", "Concurrent requests without a session id",
                         args={"model": args.model, "requests": requests, "tokens": tokens, "repeats": args.repeats})
    walls: dict[str, list[float]] = {"semantic": [], "mlx_lm.server": []}
    with tempfile.TemporaryDirectory(prefix="bench-sessionless-") as work:
        launches = (semantic_launch(folder, Path(work) / "state", args.pool_mb, Batching()), peer_defaults_launch(folder))
        for repeat in range(args.repeats):
            for launch in launches if repeat % 2 == 0 else launches[::-1]:
                print(f"# run {repeat + 1}/{args.repeats}, {launch.name} ({load_average()})", flush=True)
                with running(launch, Path(work)) as server:
                    wall, turns = asyncio.run(burst(server.url, requests, tokens))
                ended = sorted(t.done_at - min(x.sent_at for x in turns) for t in turns)
                print(f"#   {launch.name}: {requests} x {tokens} tokens in {wall:.1f} s; answers ended at "
                      f"{', '.join(f'{e:.1f}' for e in ended)} s", flush=True)
                walls[launch.name].append(wall)
    paired(result, f"{requests} identical requests at once, {tokens} tokens each", "wall time", "s",
           lambda wall: wall, walls["semantic"], walls["mlx_lm.server"])
    print_comparisons(result.comparisons)
    result.write(args.json)


if __name__ == "__main__":
    main()
