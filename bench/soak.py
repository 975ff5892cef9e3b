"""Soak: mixed client traffic against `semantic --serve` for a while, watching for growth.

Starts the server on a free loopback port (bench/server_probe.py, the same
launch as bench/served.py), warms it up with a few prompt cycles of traffic, then
runs the load test's traffic (bench/load_driver.py: Anthropic and OpenAI,
streamed or not, clients that drop before the first byte or mid-stream) for
``--duration`` seconds, sampling the server's RSS and block pool every
``--sample-every`` seconds. Before the traffic and after it every agent
completes the same last prompt of the cycle, so the idle pool at both ends
holds the same caches and its used blocks can be compared exactly.

Prints a table of the samples and a summary, optionally writes it all as JSON,
and exits 1 when a check fails: a bad response, a failed health probe, an
error in the server's log, a block no hot cache accounts for, a pool not
empty after evicting every agent, or growth past the limits (the lesser of
the slopes through RSS's peak and through its floor in each 10 s over the
second half of the traffic, RSS from idle start to idle end, used blocks
from idle start to idle end).

Run: ``LD_PRELOAD=... python -m bench.soak --duration 600 --json soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.load_driver import Budget, Tally, TrafficMix, cursors, run_round, settle_round  # noqa: E402
from bench.server_probe import (  # noqa: E402
    HealthProbe, PoolAccount, ServerOptions, ServerProcess, evict_all, read_account, rss_level_slope_mb_per_min,
    semantic_server, wait_idle,
)
from engine.models.loader import resolve_model  # noqa: E402
from engine.settings import default_cache_dir  # noqa: E402


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    rss_mb: float
    used_blocks: int
    cache_blocks: int
    hot_agents: int
    warm_agents: int
    active_requests: int
    requests_done: int
    failed: int


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    value: float
    limit: float

    @property
    def ok(self) -> bool:
        return self.value <= self.limit


@dataclass(slots=True)
class SoakResult:
    samples: list[Sample] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    traffic_s: float = 0.0
    idle_start: PoolAccount | None = None
    idle_end: PoolAccount | None = None
    emptied: PoolAccount | None = None
    rss_idle_start_mb: float = 0.0
    rss_idle_end_mb: float = 0.0
    health: HealthProbe | None = None
    settle_failures: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)


# A lane of an agent (engine/api/agent_lanes.py): the agent's id, then -2, -3, ...
LANE = re.compile(r"(.+)-([2-9]|[1-9][0-9]+)")

EPILOG = """\
checks (each printed as ok/FAIL; exit status 1 when one fails, 2 on bad flags):
  no request failed (a 429 with retry-after counts as rejected, not failed), every health probe
  answered, the server logged no error, the idle pool at both ends has no block that a hot cache
  does not account for, evicting every agent empties the pool, and growth stays within
  --max-rss-slope, --max-rss-growth and --max-block-growth. A lane (``AGENT-2``, ...) of an agent that
  was hot at idle start may appear on the way: a client that drops a request and sends its next at once can
  find its agent still busy with the dropped one (engine/api/agent_lanes.py); its blocks are counted apart
  from the growth and named. Any other new agent fails.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="smollm2-135m",
        help="model alias, MLX folder or .gguf file; imported into --cache-dir if needed (default: %(default)s)")
    add("--cache-dir", type=Path, default=default_cache_dir(), help="where imported models live (default: %(default)s)")
    add("--duration", type=float, default=300.0, metavar="S",
        help="seconds of traffic after the warm-up; the slope check needs minutes (default: %(default)s)")
    add("--sample-every", type=float, default=5.0, metavar="S",
        help="seconds between samples of the server's RSS and pool (default: %(default)s)")
    add("--agents", type=int, default=10, metavar="N",
        help="agents sending at once, each request after the last; even ones speak Anthropic, odd ones "
             "OpenAI (default: %(default)s)")
    add("--seed", type=int, default=7, help="seed of every agent's request mix (default: %(default)s)")
    add("--max-tokens", type=int, nargs=2, default=(4, 6), metavar=("MIN", "MAX"),
        help="each request's max_tokens, drawn from MIN..MAX (default: 4 6)")
    add("--prompt-wrap", type=int, default=5, metavar="N",
        help="an agent's prompt grows by one number per request for N requests, then starts over "
             "(default: %(default)s)")
    add("--warmup-cycles", type=int, default=2, metavar="N",
        help="prompt cycles of traffic before the idle start is measured; MLX's buffer cache fills over the "
             "first hundred or so requests (default: %(default)s)")
    add("--pool-mb", type=float, default=256.0, metavar="MIB",
        help="the server's KV pool budget; small enough values force evictions to disk, and side requests "
             "(Anthropic agents here, max_tokens <= 32) may then be refused with 429 (default: %(default)s)")
    add("--block-tokens", type=int, default=16, metavar="N",
        help="the server's tokens per KV block; small blocks make every turn trim and grow its cache "
             "(default: %(default)s)")
    add("--blas-threads", type=int, default=1, metavar="N",
        help="OPENBLAS_NUM_THREADS of the server, 0 to inherit; one thread is faster on a small shared "
             "machine (default: %(default)s)")
    add("--malloc-arenas", type=int, default=2, metavar="N",
        help="MALLOC_ARENA_MAX of the server, 0 to inherit; glibc's default of many arenas lets idle RSS "
             "wander over ~100 MiB and hides slow leaks (default: %(default)s)")
    add("--max-rss-slope", type=float, default=30.0, metavar="MIB_PER_MIN",
        help="fail when the server's RSS rises faster than this: the lesser of the least-squares slopes "
             "through its peak and through its floor in each 10 s of the second half of the traffic "
             "(default: %(default)s)")
    add("--max-rss-growth", type=float, default=128.0, metavar="MIB",
        help="fail when RSS at idle end exceeds RSS at idle start by more than this; RSS may step up once "
             "by 60-80 MiB as MLX's buffer cache and malloc settle, a leak keeps climbing "
             "(default: %(default)s)")
    add("--max-block-growth", type=int, default=0, metavar="BLOCKS",
        help="fail when the idle pool uses more blocks at the end than at the start; 0 is exact when nothing "
             "was evicted, with evictions which agents stay hot may differ (default: %(default)s)")
    add("--json", type=Path, metavar="PATH",
        help="also write args, samples, request counts, idle pool accounts, health and checks as JSON")
    add("--log-dir", type=Path, metavar="DIR", help="keep the server's log here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if min(args.duration, args.sample_every, args.agents, args.prompt_wrap) <= 0 or args.warmup_cycles < 0:
        parser.error("--duration, --sample-every, --agents and --prompt-wrap must be positive, "
                     "--warmup-cycles at least 0")
    if not 1 <= args.max_tokens[0] <= args.max_tokens[1]:
        parser.error("--max-tokens needs 1 <= MIN <= MAX")
    return args


async def sample_until(server: ServerProcess, client: httpx.AsyncClient, tally: Tally, t0: float, every_s: float,
                       stop: asyncio.Event, out: list[Sample]) -> None:
    while not stop.is_set():
        account = await read_account(client)
        out.append(Sample(round(time.monotonic() - t0, 1), round(server.rss_mb(), 1), account.used_blocks,
                          account.cache_blocks, account.hot_agents, account.warm_agents, account.active_requests,
                          tally.total, tally.counts["failed"]))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def soak(server: ServerProcess, mix: TrafficMix, args: argparse.Namespace) -> SoakResult:
    result = SoakResult(health=HealthProbe(server.url))
    agents = cursors(mix)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        warm = await run_round(server.url, mix, agents, Budget(requests=args.warmup_cycles * mix.prompt_wrap))
        result.settle_failures += warm.failures + (await settle_round(server.url, mix)).failures
        result.idle_start, result.rss_idle_start_mb = await wait_idle(client), server.rss_mb()

        stop = asyncio.Event()
        t0 = time.monotonic()
        sampling = sample_until(server, client, result.tally, t0, args.sample_every, stop, result.samples)
        watchers = [asyncio.create_task(result.health.run(stop)), asyncio.create_task(sampling)]
        await run_round(server.url, mix, agents, Budget(until=t0 + args.duration), result.tally)
        result.traffic_s = time.monotonic() - t0
        stop.set()
        await asyncio.gather(*watchers)

        result.settle_failures += (await settle_round(server.url, mix)).failures
        result.idle_end, result.rss_idle_end_mb = await wait_idle(client), server.rss_mb()
        result.emptied = await evict_all(client)
    result.log_errors = server.log_errors()
    return result


def new_agents(start: PoolAccount, end: PoolAccount) -> tuple[list[str], list[str]]:
    """Agents hot at idle end and not at idle start: (lanes of agents hot at the start, the others)."""
    before = {agent for agent, _ in start.hot_tokens}
    new = [agent for agent, _ in end.hot_tokens if agent not in before]
    lanes = [a for a in new if (m := LANE.fullmatch(a)) is not None and m.group(1) in before]
    return lanes, [a for a in new if a not in lanes]


def checks(result: SoakResult, args: argparse.Namespace) -> list[Check]:
    start, end, emptied, health = result.idle_start, result.idle_end, result.emptied, result.health
    assert start is not None and end is not None and emptied is not None and health is not None
    second_half = [(s.t_s, s.rss_mb) for s in result.samples if s.t_s >= result.traffic_s / 2]
    return [
        Check("failed requests", result.tally.counts["failed"] + len(result.settle_failures), 0),
        Check("failed health probes", len(health.failures), 0),
        Check("server log errors", len(result.log_errors), 0),
        Check("pool accounting problems at idle", len(start.problems) + len(end.problems) + len(emptied.problems), 0),
        Check("blocks no hot cache holds, idle end", end.unaccounted, 0),
        Check("used blocks after evicting all", emptied.used_blocks, 0),
        Check("RSS slope of 10-s peaks and floors (the lesser), second half (MiB/min)",
              round(rss_level_slope_mb_per_min(second_half), 2), args.max_rss_slope),
        Check("RSS growth idle start -> end (MiB)", round(result.rss_idle_end_mb - result.rss_idle_start_mb, 1),
              args.max_rss_growth),
        Check("agents new at idle end that are not lanes of idle-start agents", len(new_agents(start, end)[1]), 0),
        Check("used blocks growth idle start -> end (blocks only new lanes hold left out)",
              end.used_blocks - end.held_only_by(set(new_agents(start, end)[0])) - start.used_blocks,
              args.max_block_growth),
    ]


SAMPLE_COLUMNS = ("t_s", "rss_mb", "used_blocks", "cache_blocks", "hot_agents", "warm_agents", "active_requests",
                  "requests_done", "failed")


def print_samples(samples: list[Sample]) -> None:
    widths = [max(len(c), 7) for c in SAMPLE_COLUMNS]
    print("  ".join(c.rjust(w) for c, w in zip(SAMPLE_COLUMNS, widths)))
    for sample in samples:
        cells = (f"{v:.1f}" if isinstance(v, float) else str(v) for v in astuple(sample))
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)))


def print_summary(result: SoakResult, found: list[Check]) -> None:
    tally, health, start, end, emptied = result.tally, result.health, result.idle_start, result.idle_end, result.emptied
    assert health and start and end and emptied
    peak = max((s.rss_mb for s in result.samples), default=0.0)
    print(f"\ntraffic: {tally.summary()} in {result.traffic_s:.0f} s ({tally.total / result.traffic_s:.1f} req/s)\n"
          f"health: {health.answered} answers, {len(health.failures)} failures, "
          f"slowest {health.slowest_s * 1000:.0f} ms\n"
          f"RSS idle start {result.rss_idle_start_mb:.1f} MiB, idle end {result.rss_idle_end_mb:.1f} MiB, "
          f"peak {peak:.1f} MiB\n"
          f"idle start: {start.line()}\nidle end:   {end.line()}\nevicted:    {emptied.line()}")
    notes = [f"problem: {p}" for p in (*start.problems, *end.problems, *emptied.problems)]
    tokens = dict(end.hot_tokens)
    lanes, others = new_agents(start, end)
    notes += [f"new lane (a dropped request's agent was still busy): {a} ({tokens[a]} tokens)" for a in lanes]
    notes += [f"hot at idle end, not at idle start: {a} ({tokens[a]} tokens)" for a in others]
    notes += [f"failure: {f}" for f in tally.failures + result.settle_failures]
    notes += [f"server log: {line[:500]}" for line in result.log_errors]
    for note in notes[:40]:
        print(f"  {note}")
    print()
    for check in found:
        print(f"{'ok  ' if check.ok else 'FAIL'} {check.name}: {check.value:g} (limit {check.limit:g})")


def report_json(args: argparse.Namespace, result: SoakResult, found: list[Check]) -> dict:
    accounts = {"idle_start": result.idle_start, "idle_end": result.idle_end, "emptied": result.emptied}
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "samples": [asdict(s) for s in result.samples],
        "requests": {**result.tally.counts, "total": result.tally.total, "by_kind": result.tally.by_kind,
                     "failures": result.tally.failures + result.settle_failures},
        "traffic_s": round(result.traffic_s, 1),
        "rss_idle_start_mb": round(result.rss_idle_start_mb, 1), "rss_idle_end_mb": round(result.rss_idle_end_mb, 1),
        "pool": {name: asdict(account) for name, account in accounts.items() if account is not None},
        "health": {"answered": result.health.answered, "failures": result.health.failures,
                   "slowest_s": round(result.health.slowest_s, 3)} if result.health else None,
        "log_errors": result.log_errors[:100],
        "checks": [{**asdict(c), "ok": c.ok} for c in found],
        "passed": all(c.ok for c in found),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resolved = resolve_model(args.model, args.cache_dir)
    if not resolved.is_local:
        raise SystemExit(f"{args.model!r} is a hub id; pass a local MLX folder, a .gguf file or a packaged alias")
    mix = TrafficMix(agents=args.agents, seed=args.seed, max_tokens=tuple(args.max_tokens),
                     prompt_wrap=args.prompt_wrap, tag="soak")
    options = ServerOptions(pool_mb=args.pool_mb, block_tokens=args.block_tokens,
                            blas_threads=args.blas_threads or None, malloc_arenas=args.malloc_arenas or None)
    with tempfile.TemporaryDirectory(prefix="semantic-soak-") as work:
        log_dir = args.log_dir or Path(work)
        log_dir.mkdir(parents=True, exist_ok=True)
        with semantic_server(Path(resolved.location), Path(work) / "state", log_dir, options) as server:
            print(f"# soak: {resolved.location}, {args.agents} agents, {args.duration:.0f} s, "
                  f"server pid {server.pid} at {server.url}, log {server.log_path}", flush=True)
            result = asyncio.run(soak(server, mix, args))
    found = checks(result, args)
    print_samples(result.samples)
    print_summary(result, found)
    if args.json:
        args.json.write_text(json.dumps(report_json(args, result, found), indent=2))
    return 0 if all(c.ok for c in found) else 1


if __name__ == "__main__":
    sys.exit(main())
