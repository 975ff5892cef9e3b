"""Fork-and-continue vs starting the same workers cold (issue 16).

A planner's turn leaves a ~4K-token context (SmolLM2 by default). Eight
workers then each continue it with their own instruction, all at once:

- **forked**: ``fork_agent`` eight times (the planner's blocks shared by
  reference), then the eight worker turns;
- **cold**: a fresh engine (same settings, nothing cached) gets the same eight
  worker prompts as new agents. Prefix sharing is on, as by default: agents
  that start together with a common head wait for one of them to compute it
  (engine/runtime/scheduler/shared_prefill.py), so this is already the engine's best
  cold start, not eight separate prefills.

Reported per path: wall time from the first fork (or first submission) to the
last worker's finish, worker TTFTs, and prompt tokens prefilled. The planner's
own turn is not inside either window.

Run: ``LD_PRELOAD=... python -m bench.bench_fork [--quick] [--json PATH]``.
"""

from __future__ import annotations

import time

from bench.common import base_parser, load, median, print_table, start_engine
from bench.results import BenchResult

from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn, run_turns

WORKERS = 8
REPLY = 16


def planner_prompt(loaded, words: int) -> tuple[int, ...]:
    tasks = " ".join(f"Task {i}: check module {i} for errors and report line {(i * 13) % 97}." for i in range(words // 11))
    messages = [{"role": "system", "content": f"You are a planner. Split the work below among workers.\n{tasks}"},
                {"role": "user", "content": "Assign the tasks to eight workers."}]
    return tuple(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def worker_suffix(loaded, i: int) -> tuple[int, ...]:
    return tuple(loaded.tokenizer.encode(f"\nWorker {i}: do task {i} now, and report back.\n"))


def forked(loaded, pool_mb: float, planner: tuple[int, ...]) -> tuple[float, list, int]:
    engine = start_engine(loaded, pool_mb)
    try:
        plan = run_turn(engine, GenerationRequest("planner", planner, REPLY), timeout_s=3600)
        context = planner + tuple(plan.tokens)
        started = time.perf_counter()
        for i in range(WORKERS):
            engine.call(lambda e, i=i: e.ops.fork_agent("planner", f"worker-{i}")).result()
        results = run_turns(engine, [GenerationRequest(f"worker-{i}", context + worker_suffix(loaded, i), REPLY)
                                     for i in range(WORKERS)], timeout_s=3600)
        return time.perf_counter() - started, results, len(context)
    finally:
        engine.stop()


def cold(loaded, pool_mb: float, context: tuple[int, ...]) -> tuple[float, list]:
    engine = start_engine(loaded, pool_mb)
    try:
        started = time.perf_counter()
        results = run_turns(engine, [GenerationRequest(f"worker-{i}", context + worker_suffix(loaded, i), REPLY)
                                     for i in range(WORKERS)], timeout_s=3600)
        return time.perf_counter() - started, results
    finally:
        engine.stop()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    loaded = load(args)
    words = 600 if args.quick else 2250
    planner = planner_prompt(loaded, words)
    result = BenchResult("bench_fork", "Fork eight workers from a planner vs start them cold",
                         args={"model": args.model, "workers": WORKERS, "quick": args.quick,
                               "planner_prompt_tokens": len(planner)})
    began = time.perf_counter()
    fork_s, fork_results, context_len = forked(loaded, args.pool_mb, planner)
    # The cold workers get exactly the context the forks continued (the planner's prompt and reply).
    context = fork_results[0].request.prompt_tokens[:context_len]
    cold_s, cold_results = cold(loaded, args.pool_mb, context)
    rows = []
    for label, seconds, results in (("forked", fork_s, fork_results), ("cold", cold_s, cold_results)):
        usages = [r.finish.usage for r in results]
        prefilled = sum(u.prefilled_tokens for u in usages)
        ttft = median([u.ttft_s for u in usages])
        rows.append([label, seconds, ttft, prefilled, sum(u.reused_tokens for u in usages)])
        result.metric("wall time, 8 workers", label, seconds, "s", better="lower")
        result.metric("worker TTFT p50", label, ttft, "s", better="lower")
        result.metric("prompt tokens prefilled", label, prefilled, "tok", better="lower")
    print(f"# planner context {context_len} tokens; {WORKERS} workers, {REPLY} tokens each")
    print_table(["path", "wall s", "TTFT p50 s", "prefilled", "reused"], rows)
    speedup = cold_s / max(fork_s, 1e-9)
    print(f"forked is {speedup:.1f}x faster than cold, prefilling {rows[0][3]} tokens instead of {rows[1][3]}")
    result.metric("speed-up of forking", "cold wall / forked wall", speedup, "x")
    result.duration_s = time.perf_counter() - began
    result.write(args.json)


if __name__ == "__main__":
    main()
