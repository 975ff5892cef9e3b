"""Watching a `semantic --serve` process under load: its RSS, its health, its block pool.

``semantic_server`` starts the server the way bench/served.py does (same
flags, environment and warm-up) but also hands out its pid, for RSS.

``pool_account`` checks the pool from ``GET /v1/stats?blocks=true`` alone.
Once idle, every used block must belong to a hot agent's cache, and an
agent's cache of ``n`` tokens holds exactly ``ceil(n / block_tokens)``
blocks per full-attention layer group (sliding-window groups at most that):
a block left in a finished turn's reservation, or held by an agent that is
no longer hot, shows up as a mismatch. The traffic gives every agent its own
prompt prefix, so no block is shared and the per-block owner map is exact.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.served import Batching, running, semantic_launch  # noqa: E402

MIB = 1024 * 1024
# The engine republishes its snapshot every 0.2 s; idle must hold this long to count.
IDLE_HOLD_S = 1.5


# -- the server process ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ServerProcess:
    url: str
    pid: int
    log_path: Path

    def rss_mb(self) -> float:
        return psutil.Process(self.pid).memory_info().rss / MIB

    def log_errors(self) -> list[str]:
        """Log lines at level error or worse, and lines that are not JSON (a traceback printed raw)."""
        bad = []
        for line in filter(None, self.log_path.read_text(errors="replace").splitlines()):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or record.get("level") in ("error", "critical"):
                bad.append(line)
        return bad


@dataclass(frozen=True, slots=True)
class ServerOptions:
    pool_mb: float = 256.0
    block_tokens: int = 16  # small blocks: every turn crosses boundaries, trims and grows
    max_batch_size: int = 16
    prefill_batch_size: int = 4
    # OPENBLAS_NUM_THREADS for the server; None inherits. On a small shared box one thread is faster:
    # a second BLAS thread spin-waits for a core that other work holds.
    blas_threads: int | None = 1
    # MALLOC_ARENA_MAX for the server; None inherits. glibc gives threads their own malloc arenas, and
    # which arena keeps freed memory depends on which thread ran when: with the default up to 16 arenas
    # here, idle RSS of the same server wanders over a ~100 MiB band, which would hide a slow leak.
    # Two arenas keep it within ~15 MiB at no measurable cost in speed.
    malloc_arenas: int | None = 2


def server_env_overrides(options: ServerOptions) -> dict[str, str]:
    env = {}
    if options.blas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(options.blas_threads)
    if options.malloc_arenas is not None:
        env["MALLOC_ARENA_MAX"] = str(options.malloc_arenas)
    return env


@contextmanager
def semantic_server(model: Path, state_dir: Path, log_dir: Path, options: ServerOptions) -> Iterator[ServerProcess]:
    """``semantic --serve`` on a free loopback port, warmed up; stopped with SIGTERM on exit."""
    launch = semantic_launch(model, state_dir, options.pool_mb,
                             Batching(decode=options.max_batch_size, prefill=options.prefill_batch_size))
    launch = replace(launch, argv=(*launch.argv, "--block-tokens", str(options.block_tokens)))
    with running(launch, log_dir, env_overrides=server_env_overrides(options)) as server:
        yield ServerProcess(server.url, server.process.pid, server.log_path)


# -- pool accounting -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PoolAccount:
    at: float
    used_blocks: int
    total_blocks: int
    shared_blocks: int
    hot_agents: int
    warm_agents: int
    busy_agents: tuple[str, ...]
    active_requests: int
    requests_total: int
    cache_blocks: int  # what the hot agents' cached tokens need
    problems: tuple[str, ...] = ()
    # The hot agents by id, with their cached tokens: which agent a growth between two accounts came from.
    hot_tokens: tuple[tuple[str, int], ...] = ()
    # Each used block's holders (what blocks only some agents hold: soak.py leaves a new lane's out of growth).
    block_holders: tuple[tuple[str, ...], ...] = ()

    def held_only_by(self, agents: set[str]) -> int:
        """Used blocks whose every holder is one of ``agents``."""
        return sum(1 for ids in self.block_holders if ids and set(ids) <= agents)

    @property
    def idle(self) -> bool:
        return self.active_requests == 0 and not self.busy_agents

    @property
    def unaccounted(self) -> int:
        return self.used_blocks - self.cache_blocks

    def line(self) -> str:
        return (f"used {self.used_blocks}/{self.total_blocks} blocks, {self.cache_blocks} in hot caches, "
                f"{self.hot_agents} hot / {self.warm_agents} warm agents, {len(self.busy_agents)} busy, "
                f"{self.active_requests} active requests")


def group_blocks(tokens: int, kind: str, block_tokens: int) -> int:
    """Blocks the positions of a cache of ``tokens`` need in one layer group (sliding: at most the window)."""
    full = math.ceil(tokens / block_tokens)
    if kind == "global":
        return full
    window = int(kind.removeprefix("sliding-"))
    return min(full, math.ceil(window / block_tokens))


def growth_blocks(tokens: int, block_tokens: int) -> int:
    """Capacity a settled full-attention cache may keep beyond its positions (the engine's growth step)."""
    return math.ceil(max(block_tokens, tokens // 8) / block_tokens)


def pool_account(stats: dict[str, Any]) -> PoolAccount:
    pool, spec = stats["pool"], stats["model"]["cache_spec"]
    block_tokens, groups = spec["block_tokens"], spec["groups"]
    block_map = pool["block_map"]
    # Every holder of every block: a prefix block that agents share counts in each one's cache.
    holders = block_map.get("holders") or [[o] if o is not None else [] for o in block_map["owners"]]
    held = Counter((agent, group) for ids, group in zip(holders, block_map["groups"]) for agent in ids)
    hot = {a["agent_id"]: a for a in stats["agents"] if a["tier"] == "hot"}
    problems = _owner_problems(held, hot, block_tokens, groups)
    mapped = sum(1 for ids in holders if ids)
    if mapped != pool["used_blocks"]:
        problems.append(f"block map shows {mapped} used blocks, the pool counts {pool['used_blocks']}")
    if sum(1 for ids in holders if len(ids) > 1) != pool["shared_blocks"]:
        problems.append(f"the block map shows {sum(1 for ids in holders if len(ids) > 1)} shared blocks, the pool "
                        f"counts {pool['shared_blocks']}")
    tiers = stats["tiers"]
    if tiers["hot_array_bytes"] != pool["used_bytes"]:
        problems.append(f"the hot caches' arrays measure {tiers['hot_array_bytes']} bytes, the pool counts "
                        f"{pool['used_bytes']}")
    expected = sum(1 for ids in holders if any(agent in hot for agent in ids))  # each block once
    throughput = stats["throughput"]
    return PoolAccount(
        at=time.monotonic(), used_blocks=pool["used_blocks"], total_blocks=pool["total_blocks"],
        shared_blocks=pool["shared_blocks"], hot_agents=stats["tiers"]["hot_agents"],
        warm_agents=stats["tiers"]["warm_agents"],
        busy_agents=tuple(a["agent_id"] for a in stats["agents"] if a["state"] != "idle"),
        active_requests=throughput["active_requests"], requests_total=throughput["requests_total"],
        cache_blocks=expected, problems=tuple(problems),
        hot_tokens=tuple(sorted((agent, int(a.get("cached_tokens", 0))) for agent, a in hot.items())),
        block_holders=tuple(tuple(ids) for ids in holders if ids),
    )


def _owner_problems(held: Counter, hot: dict[str, dict[str, Any]], block_tokens: int,
                    groups: list[dict[str, Any]]) -> list[str]:
    problems = [f"{n} blocks of group {group} held by {owner!r}, which is not a hot agent"
                for (owner, group), n in held.items() if owner is not None and owner not in hot]
    for agent_id, agent in hot.items():
        tokens = agent["cached_tokens"]
        for g in groups:
            have = held.get((agent_id, g["index"]), 0)
            need = group_blocks(tokens, g["kind"], block_tokens)
            # Every position needs its block; beyond that a full-attention cache keeps at most one growth
            # step, a window at most its ring, plus the checkpoints of that ring.
            most = need + growth_blocks(tokens, block_tokens) if g["kind"] == "global" else None
            if have < need or (most is not None and have > most):
                bound = f"{need}..{most}" if most is not None else f">= {need}"
                problems.append(f"{agent_id}: {have} blocks in group {g['index']} for {tokens} cached tokens "
                                f"(expected {bound})")
    return problems


async def read_account(client: httpx.AsyncClient) -> PoolAccount:
    response = await client.get("/v1/stats", params={"blocks": "true"})
    response.raise_for_status()
    return pool_account(response.json())


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 60.0) -> PoolAccount:
    """The pool once nothing has run for ``IDLE_HOLD_S`` (a dropped request may still be on its way in)."""
    deadline = time.monotonic() + timeout_s
    since: PoolAccount | None = None
    while time.monotonic() < deadline:
        account = await read_account(client)
        if not account.idle or since is None or account.requests_total != since.requests_total:
            since = account if account.idle else None
        elif account.at - since.at >= IDLE_HOLD_S:
            return account
        await asyncio.sleep(0.2)
    raise TimeoutError(f"server not idle after {timeout_s:.0f} s: {(await read_account(client)).line()}")


async def evict_all(client: httpx.AsyncClient, tier: str = "cold") -> PoolAccount:
    """Evict every idle agent; the pool must then be empty."""
    response = await client.post("/v1/admin/evict-idle", json={"tier": tier})
    response.raise_for_status()
    return await read_account(client)


# -- sampling while traffic runs ------------------------------------------------------------------------
@dataclass(slots=True)
class HealthProbe:
    """GET /health/live every ``interval_s``; keeps failures and the slowest answer."""

    url: str
    interval_s: float = 0.5
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    slowest_s: float = 0.0

    async def run(self, stop_event: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(15, connect=5)) as client:
            while not stop_event.is_set():
                began = time.monotonic()
                try:
                    response = await client.get("/health/live")
                    if response.status_code == 200:
                        self.answered += 1
                    else:
                        self.failures.append(f"HTTP {response.status_code}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.slowest_s = max(self.slowest_s, time.monotonic() - began)
                try:
                    await asyncio.wait_for(stop_event.wait(), self.interval_s)
                except asyncio.TimeoutError:
                    pass


PEAK_WINDOW_S = 10.0


def rss_level_slope_mb_per_min(samples: list[tuple[float, float]], window_s: float = PEAK_WINDOW_S) -> float:
    """How fast RSS's levels rise, in MiB/min: the lesser of the least-squares slopes through the highest
    and through the lowest RSS in each ``window_s`` of (seconds, MiB) samples.

    Under traffic RSS can alternate between two levels ~12 MiB apart from one
    2-s sample to the next (the allocator returning and retaking a step's
    temporaries): a slope through the raw samples then reads tens of MiB/min
    over a 30-s window with nothing growing. Each window's peak sits on the
    upper level and its floor on the lower one, so both stay flat while the
    alternation goes on, and both climb with a leak. Either alone can read a
    slope from one window that missed its level (two CI soaks:
    the raw samples, then the peaks, read 19-22 MiB/min), but not
    both at once: the upper level is the rarer one when the peaks miss it.
    """
    if not samples:
        return 0.0
    first = samples[0][0]
    peaks: dict[int, tuple[float, float]] = {}
    floors: dict[int, tuple[float, float]] = {}
    for t, mb in samples:
        window = int((t - first) // window_s)
        if window not in peaks or mb >= peaks[window][1]:
            peaks[window] = (t, mb)
        if window not in floors or mb <= floors[window][1]:
            floors[window] = (t, mb)
    return min(rss_slope_mb_per_min([peaks[w] for w in sorted(peaks)]),
               rss_slope_mb_per_min([floors[w] for w in sorted(floors)]))


def rss_slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_m = sum(m for _, m in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mean_t) * (m - mean_m) for t, m in samples) / var
