"""Model hot-swap latency and memory: SmolLM2 -> Gemma 3 270M -> SmolLM2.

Prints each swap's phase breakdown (drain, spill, unload, load, rebuild),
how many agent caches were spilled, and MLX active memory at a fresh start,
after each unload and after each load; the round trip must come back within
5% of the fresh start (the seeds' EXP-011).

Run: ``make bench`` or ``LD_PRELOAD=... python -m bench.bench_swap [--quick] [--json PATH]``.
"""

from __future__ import annotations

import tempfile
import time

from bench.common import base_parser, print_table
from bench.results import BenchResult, Series, recorded

from engine.api.service import EngineService
from engine.bootstrap import build_engine, engine_builder, load_configured_model
from engine.models.loader import resolve_model
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turns
from engine.settings import load_settings
from engine.swap import SwapPhase, SwapStatus, memory_reading

MODELS = ("smollm2-135m", "gemma3-270m")
PHASES = ("draining", "spilling", "unloading", "loading", "rebuilding")


def start_service(settings) -> EngineService:
    service = EngineService(settings, None)
    engine = build_engine(settings, load_configured_model(settings), service.events)
    engine.start()
    service.attach(engine)
    service.enable_swaps(engine_builder(settings, service.events))
    return service


def fill_agents(service: EngineService, agents: int, words: int) -> None:
    tokenizer = service.engine.loaded.tokenizer
    requests = []
    for i in range(agents):
        text = f"Agent {i} notes: " + " ".join(f"item{j}={j * i % 97}" for j in range(words))
        if getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            prompt = tokenizer.encode(text)
        requests.append(GenerationRequest(f"agent-{i}", tuple(prompt), 8))
    run_turns(service.engine, requests, timeout_s=3600)


def swap(service: EngineService, ref: str) -> tuple[SwapStatus, float]:
    """The swapper's final status, and the wall time from the request to done."""
    started = time.perf_counter()
    service.swapper.request(ref, grace_s=5)
    status = service.swapper.wait(3600)
    assert status.phase is SwapPhase.DONE, status.error
    return status, time.perf_counter() - started


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    result = BenchResult("bench_swap", "Model hot-swap: latency and memory",
                         {"quick": args.quick, "pool_mb": args.pool_mb, "models": list(MODELS)})
    with recorded(result, args.json):
        run(args, result)


def run(args, result: BenchResult) -> None:
    small, big = (resolve_model(alias, args.cache_dir).location for alias in MODELS)
    # Models come from the shared cache; agents' warm files go to a scratch directory.
    with tempfile.TemporaryDirectory() as scratch:
        settings = load_settings(cache_dir=scratch, model=small, pool_budget_mb=args.pool_mb,
                                 preload_openblas=False, disk_budget_mb=4096)
        service = start_service(settings)
        fresh = memory_reading()["mlx_active"]
        agents, words = (2, 50) if args.quick else (6, 300)
        fill_agents(service, agents, words)
        hops = [(MODELS[0], MODELS[1], big), (MODELS[1], MODELS[0], small)]
        rows, memory = [], [[f"fresh start ({MODELS[0]})", fresh / 2**20]]
        for source, target, location in hops:
            status, wall = swap(service, location)
            fill_agents(service, agents, words)
            rows.append([f"{source} -> {target}", status.spilled_agents, status.spilled_bytes / 2**20,
                         *(status.seconds.get(p, 0.0) for p in PHASES), status.total_seconds, wall])
            memory.append([f"after unload ({source})", status.memory.get("after_unload", 0) / 2**20])
            memory.append([f"after load ({target})", status.memory.get("after", 0) / 2**20])
        service.engine.stop(0)
    print("\n## Swap latency (seconds per phase)")
    print_table(["swap", "agents spilled", "spilled MiB", *PHASES, "total s", "wall s"], rows)
    print("\n## MLX active memory (MiB)")
    print_table(["moment", "MiB"], memory)
    back = memory[-1][1]
    drift = abs(back - fresh / 2**20) / (fresh / 2**20)
    print(f"\nround trip vs fresh start: {drift:.2%} ({'within' if drift <= 0.05 else 'OVER'} the 5% target)")
    record(result, rows, memory, drift)


def record(result: BenchResult, rows: list[list], memory: list[list], drift: float) -> None:
    for label, spilled, spilled_mib, *phases, total, wall in rows:
        group = f"swap {label}"
        result.metric(group, "agents spilled", spilled, "agents", "neither")
        result.metric(group, "spilled", spilled_mib, "MiB", "neither")
        for phase, seconds in zip(PHASES, phases):
            result.metric(group, phase, seconds, "s", "lower")
        result.metric(group, "total (swapper)", total, "s", "lower")
        result.metric(group, "wall (request to done)", wall, "s", "lower")
    for moment, mib in memory:
        result.metric("MLX active memory", moment, mib, "MiB", "lower")
    result.metric("MLX active memory", "round trip vs fresh start", 100 * drift, "%", "lower", target=5.0)
    result.series.append(Series("swap latency by phase", "swap", "s", list(range(1, len(rows) + 1)),
                                {phase: [row[3 + i] for row in rows] for i, phase in enumerate(PHASES)}, "bar",
                                [row[0] for row in rows]))

if __name__ == "__main__":
    main()
