"""Model hot-swap latency and memory: SmolLM2 -> Gemma 3 270M -> SmolLM2.

Prints each swap's phase breakdown (drain, spill, unload, load, rebuild),
how many agent caches were spilled, and MLX active memory at a fresh start,
after each unload and after each load; the round trip must come back within
5% of the fresh start (the seeds' EXP-011).

Run: ``make bench`` or ``LD_PRELOAD=... python bench/bench_swap.py [--quick]``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import base_parser, print_table

from engine.api.service import EngineService
from engine.bootstrap import build_engine, engine_builder, load_configured_model
from engine.models.loader import resolve_model
from engine.runtime.requests import GenerationRequest
from engine.runtime.sync_client import run_turns
from engine.settings import load_settings
from engine.swap import SwapPhase, memory_reading

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


def swap(service: EngineService, ref: str) -> dict:
    started = time.perf_counter()
    service.swapper.request(ref, grace_s=5)
    status = service.swapper.wait(3600)
    assert status.phase is SwapPhase.DONE, status.error
    return {"wall": time.perf_counter() - started, "status": status}


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    smol = resolve_model("smollm2-135m", args.cache_dir).location
    gemma = resolve_model("gemma3-270m", args.cache_dir).location
    # Models come from the shared cache; agents' warm files go to a scratch directory.
    with tempfile.TemporaryDirectory() as scratch:
        settings = load_settings(cache_dir=scratch, model=smol, pool_budget_mb=args.pool_mb,
                                 preload_openblas=False, disk_budget_mb=4096)
        service = start_service(settings)
        fresh = memory_reading()["mlx_active"]
        agents, words = (2, 50) if args.quick else (6, 300)
        fill_agents(service, agents, words)
        hops = [(smol, gemma), (gemma, smol)]
        rows, memory = [], [["fresh start (SmolLM2)", fresh / 2**20]]
        for source, target in hops:
            result = swap(service, target)
            status = result["status"]
            fill_agents(service, agents, words)
            rows.append([f"{Path(source).name[:18]} -> {Path(target).name[:18]}", status.spilled_agents,
                         status.spilled_bytes / 2**20, *(status.seconds.get(p, 0.0) for p in PHASES),
                         status.total_seconds, result["wall"]])
            memory.append([f"after unload ({Path(source).name[:18]})", status.memory.get("after_unload", 0) / 2**20])
            memory.append([f"after load ({Path(target).name[:18]})", status.memory.get("after", 0) / 2**20])
        service.engine.stop(0)
    print("\n## Swap latency (seconds per phase)")
    print_table(["swap", "agents spilled", "spilled MiB", *PHASES, "total s", "wall s"], rows)
    print("\n## MLX active memory (MiB)")
    print_table(["moment", "MiB"], memory)
    back = memory[-1][1]
    drift = abs(back - fresh / 2**20) / (fresh / 2**20)
    print(f"\nround trip vs fresh start: {drift:.2%} ({'within' if drift <= 0.05 else 'OVER'} the 5% target)")


if __name__ == "__main__":
    main()
