"""Cache-store benchmark: what the warm tier and prefix sharing save.

1. Resume time-to-first-token of 2K/4K/8K-token conversations restored from
   the warm tier (disk) vs a cold re-prefill of the same prompt.
2. Disk save/load throughput of the store vs a plain copy of the same file.
3. A 16-agent multi-turn workload on a pool that fits ~6 agents, with the
   warm tier vs without it (evicted agents re-prefill).
4. 8 agents sharing a long system prompt: prompt tokens from each agent's own cache and from
   another agent's prefix, reported separately.

Run: ``make bench`` or ``LD_PRELOAD=... python -m bench.bench_cache_store [--quick] [--json PATH]``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import base_parser, load, print_table, render_chat, start_engine
from bench.results import BenchResult, Series, recorded

from engine.runtime.tiers.agents import Tier
from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.cache_file import read_cache_file
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model


def facts(loaded, n_tokens: int) -> str:
    """Filler text of about ``n_tokens`` tokens of this model's tokenizer."""
    sentences: list[str] = []
    while len(loaded.tokenizer.encode(" ".join(sentences))) < n_tokens:
        start = len(sentences)
        sentences += [f"Fact {i}: item {i} weighs {i * 7 % 101} grams." for i in range(start, start + 25)]
    return " ".join(sentences)


def drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# -- 1 + 2: resume from warm vs cold prefill, and disk throughput --------------------------------
def resume_vs_cold(loaded, pool_mb: float, sizes: list[int], result: BenchResult) -> None:
    print("\n## Resume TTFT: restored from the warm tier vs cold re-prefill")
    rows, io_rows = [], []
    for size in sizes:
        with tempfile.TemporaryDirectory() as root:
            store = WarmStore(Path(root), stored_model(loaded), 1 << 40, EventLog())
            # No prefix sharing here: the cold agent must really prefill.
            engine = start_engine(loaded, pool_mb, store=store, prefix_sharing=False)
            try:
                rows.append(_one_resume(engine, loaded, size, io_rows))
            finally:
                engine.stop()
    print_table(["prompt tokens", "TTFT warm s", "TTFT cold s", "speed-up x", "page cache dropped"], rows)
    print("\n## Disk throughput of the warm tier vs a plain file copy (same bytes)")
    print_table(["file MB", "save MB/s", "load MB/s", "copy+fsync MB/s", "save/copy", "load/copy"], io_rows)
    record_resume(result, sizes, rows, io_rows)


def record_resume(result: BenchResult, sizes: list[int], rows: list[list], io_rows: list[list]) -> None:
    for size, (tokens, warm, cold, speed_up, dropped), io in zip(sizes, rows, io_rows):
        group = f"resume from the warm tier, {size}-token conversation"
        result.metric(group, "prompt tokens", tokens, "tokens", "neither")
        result.metric(group, "TTFT warm (restored from disk)", warm, "s", "lower")
        result.metric(group, "TTFT cold (re-prefill)", cold, "s", "lower")
        result.metric(group, "resume speed-up (cold / warm)", speed_up, "x")
        group = f"disk throughput, {size}-token cache file"
        for name, value, unit, better in zip(
                ("file size", "save", "load", "plain copy + fsync", "save / copy", "load / copy"), io,
                ("MB", "MB/s", "MB/s", "MB/s", "x", "x"), ("neither", "higher", "higher", "higher", "higher", "higher")):
            result.metric(group, name, value, unit, better)
    if any(row[4] == "no" for row in rows):
        result.notes.append("The page cache could not be dropped (needs root): warm resumes and loads may have "
                            "read from memory rather than disk.")
    x = [row[0] for row in rows]
    result.series.append(Series("resume TTFT: warm tier vs cold re-prefill", "prompt tokens", "TTFT s", x,
                                {"warm (from disk)": [r[1] for r in rows], "cold re-prefill": [r[2] for r in rows]},
                                "bar"))
    result.series.append(Series("disk throughput vs plain copy", "prompt tokens", "MB/s", x,
                                {name: [io[i] for io in io_rows] for i, name in
                                 ((1, "save"), (2, "load"), (3, "plain copy + fsync"))}, "bar"))


def _one_resume(engine, loaded, size: int, io_rows: list) -> list:
    messages = [{"role": "user", "content": f"Remember these facts.\n{facts(loaded, size)}\nReply OK."}]
    first = run_turn(engine, GenerationRequest("resume", render_chat(loaded, messages), 4), timeout_s=3600)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "What does item 3 weigh?"}]
    prompt = render_chat(loaded, messages)
    engine.call(lambda e: e.ops.evict_agent("resume", Tier.WARM)).result()
    engine.call(lambda e: e._store.flush()).result()
    store = engine.call(lambda e: e._store).result()
    path = store.entries["resume"].path
    dropped = drop_page_cache()
    warm = run_turn(engine, GenerationRequest("resume", prompt, 4), timeout_s=3600)
    assert warm.finish.usage.reused_tokens > size * 0.9, warm.finish.usage
    cold = run_turn(engine, GenerationRequest("resume-cold", prompt, 4), timeout_s=3600)
    io_rows.append(_io_row(store, path))
    w, c = warm.finish.usage.ttft_s, cold.finish.usage.ttft_s
    return [len(prompt), w, c, c / w, "yes" if dropped else "no"]


def _io_row(store: WarmStore, path: Path) -> list:
    """Save rate as the store's I/O thread measured it; load and copy timed here, alternating, from a cold page cache."""
    stats = store.stats
    mb = path.stat().st_size / 2**20
    loads, copies = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(2):
            copies.append(_timed_cold(lambda: _durable_copy(path, Path(tmp) / "copy")))
            loads.append(_timed_cold(lambda: read_cache_file(path, store.model.identity.digest, store.fingerprint)))
    save = (stats.bytes_written / 2**20) / max(stats.write_seconds, 1e-9)
    load, copy = mb / min(loads), mb / min(copies)
    return [mb, save, load, copy, save / copy, load / copy]


def _durable_copy(source: Path, target: Path) -> None:
    """The ceiling for a save: the same bytes copied and fsynced (the store fsyncs too)."""
    shutil.copyfile(source, target)
    with open(target, "rb") as handle:
        os.fsync(handle.fileno())


def _timed_cold(action) -> float:
    drop_page_cache()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


# -- 3: many agents, small pool ---------------------------------------------------------------
def crowded_pool(loaded, n_agents: int, turns: int, context: int, fit: int, result: BenchResult) -> None:
    print(f"\n## {n_agents} agents x {turns} turns on a pool that fits ~{fit} agents")
    blocks_per_agent = loaded.spec.total_blocks_for_tokens(context + 150)
    pool_mb = fit * blocks_per_agent * loaded.spec.block_bytes / 2**20
    rows = []
    for label, with_store in (("warm tier", True), ("no warm tier (re-prefill)", False)):
        with tempfile.TemporaryDirectory() as root:
            store = WarmStore(Path(root), stored_model(loaded), 1 << 40, EventLog()) if with_store else None
            engine = start_engine(loaded, pool_mb, store=store)
            try:
                rows.append([label, *_crowd(engine, loaded, n_agents, turns, context)])
            finally:
                engine.stop()
    print_table(["mode", "total s", "prompt tokens", "prefilled", "reused (avoided)", "avoided %"], rows)
    for label, total, prompt, prefilled, reused, avoided in rows:
        group = f"{n_agents} agents x {turns} turns on a pool for ~{fit}: {label}"
        result.metric(group, "total time", total, "s", "lower")
        result.metric(group, "prompt tokens", prompt, "tokens", "neither")
        result.metric(group, "prefilled tokens", prefilled, "tokens", "lower")
        result.metric(group, "reused tokens (prefill avoided)", reused, "tokens")
        result.metric(group, "prefill avoided", avoided, "%")
    if len(rows) == 2 and rows[0][1] > 0:
        result.metric(f"{n_agents} agents x {turns} turns on a pool for ~{fit}", "warm tier speed-up (total time)",
                      rows[1][1] / rows[0][1], "x")


def _crowd(engine, loaded, n_agents: int, turns: int, context: int) -> list:
    histories = {
        i: [{"role": "user", "content": f"You are agent {i}. Notes:\n{facts(loaded, context)}\nSay ready."}] for i in range(n_agents)
    }
    totals = {"prompt": 0, "prefilled": 0, "reused": 0}

    def turn(i: int) -> None:
        prompt = render_chat(loaded, histories[i])
        result = run_turn(engine, GenerationRequest(f"crowd-{i}", prompt, 8), timeout_s=3600)
        histories[i] += [{"role": "assistant", "content": result.text}, {"role": "user", "content": "Continue."}]
        usage = result.finish.usage
        totals["prompt"] += usage.prompt_tokens
        totals["prefilled"] += usage.prefilled_tokens
        totals["reused"] += usage.reused_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:  # four clients at a time, round robin over agents
        for _ in range(turns):
            list(pool.map(turn, range(n_agents)))
    elapsed = time.perf_counter() - t0
    return [elapsed, totals["prompt"], totals["prefilled"], totals["reused"], 100 * totals["reused"] / totals["prompt"]]


# -- 4: shared system prompt -------------------------------------------------------------------
def shared_prefix(loaded, pool_mb: float, n_agents: int, system_tokens: int, result: BenchResult) -> None:
    print(f"\n## Prefix sharing: {n_agents} agents with one {system_tokens}-token system prompt, 2 turns each")
    system = f"You are a coding agent. Tools and rules follow.\n{facts(loaded, system_tokens)}"
    engine = start_engine(loaded, pool_mb)
    prompt_total = own_reused = shared_reused = shared_hits = 0
    try:
        for i in range(n_agents):
            history = [{"role": "system", "content": system}, {"role": "user", "content": f"Task {i}: list files."}]
            for _ in range(2):
                request = GenerationRequest(f"share-{i}", render_chat(loaded, history), 8)
                turn = run_turn(engine, request, timeout_s=3600)
                usage = turn.finish.usage
                prompt_total += usage.prompt_tokens
                # An agent's reuse of its own cache and a start from another agent's prefix are
                # different things: one is the cost of a conversation, the other of a new agent.
                if usage.reuse_source == "self":
                    own_reused += usage.reused_tokens
                else:
                    shared_reused += usage.reused_tokens
                shared_hits += usage.reuse_source.startswith("shared:")
                history += [{"role": "assistant", "content": turn.text}, {"role": "user", "content": "Next step."}]
        pool = engine.fresh_snapshot().pool
    finally:
        engine.stop()
    print_table(
        ["turns", "prompt tokens", "own cache %", "shared prefix %", "first turns served by sharing", "shared blocks"],
        [[2 * n_agents, prompt_total, 100 * own_reused / prompt_total, 100 * shared_reused / prompt_total,
          f"{shared_hits}/{n_agents - 1}", pool.shared_blocks]],
    )
    group = f"prefix sharing: {n_agents} agents, one {system_tokens}-token system prompt, 2 turns each"
    result.metric(group, "prompt tokens", prompt_total, "tokens", "neither")
    result.metric(group, "prompt tokens from the agent's own cache", 100 * own_reused / prompt_total, "%")
    result.metric(group, "prompt tokens from another agent's prefix", 100 * shared_reused / prompt_total, "%")
    result.metric(group, f"first turns served by sharing (of {n_agents - 1})", shared_hits, "turns")
    result.metric(group, "shared blocks", pool.shared_blocks, "blocks", "neither")

def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("resume", "crowd", "prefix"), action="append",
                        help="run only these sections (repeatable; default: all)")
    args = parser.parse_args()
    sections = set(args.only or ("resume", "crowd", "prefix"))
    result = BenchResult("bench_cache_store", "Cache store: warm-tier resume, disk throughput, crowding, prefix sharing",
                         {"model": args.model, "quick": args.quick, "pool_mb": args.pool_mb, "sections": sorted(sections)})
    with recorded(result, args.json):
        loaded = load(args)
        if "resume" in sections:
            resume_vs_cold(loaded, args.pool_mb, [2000] if args.quick else [2000, 4000, 7800], result)
        if "crowd" in sections:
            crowded_pool(loaded, 8 if args.quick else 16, 2 if args.quick else 3, 300 if args.quick else 500, 6, result)
        if "prefix" in sections:
            shared_prefix(loaded, args.pool_mb, 4 if args.quick else 8, 1000, result)


if __name__ == "__main__":
    main()
