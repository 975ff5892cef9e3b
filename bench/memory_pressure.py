"""A steady multi-agent load while the soft memory watermark shrinks below what the machine uses, then returns.

`semantic --serve` runs with a pool big enough to keep every agent hot. Client
threads keep sending greedy turns of direct, OpenAI (``session_id``) and
Anthropic (Claude Code session header) agents, all on one system prompt. The
soft watermark (``PUT /v1/admin/memory``) then steps down: above the memory
the machine has in use, just under it, a GiB under it, and far under it; the
hard watermark stays above use (refusing is not what is measured here). Then
it goes back up. Per phase the run records every response's status, the
agents per tier, the pool's bytes, this process's footprint and what MLX
holds. At the end every agent's next turn is compared with a fresh prefill of
the same conversation (token-identical, greedy), and every agent must still
be listed with its cache somewhere (hot, cool or warm): no 5xx and no lost
agent is the target.

Run: ``LD_PRELOAD=... python -m bench.memory_pressure --model smollm2-135m --json memory.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.crash import SYSTEM, TOPICS, Agent, Server, Tally, _check_next_turn, start_workers  # noqa: E402

GIB = 2**30


@dataclass
class Phase:
    name: str
    soft_bytes: int
    statuses: Counter = field(default_factory=Counter)
    samples: list[dict] = field(default_factory=list)  # /v1/stats readings during the phase


class Load:
    """Turns of ``agents`` from a few threads; every response's status goes to the current phase."""

    def __init__(self, url: str, agents: list[Agent], seed: int) -> None:
        self.url, self.agents, self.rng = url, agents, random.Random(seed)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.phase: Phase | None = None
        self.errors: list[str] = []

    def run(self, threads: int) -> list[threading.Thread]:
        return start_workers(self._worker, self.rng, threads)

    def _worker(self, rng: random.Random) -> None:
        with httpx.Client(base_url=self.url, timeout=300) as client:
            while not self.stop.is_set():
                with self.lock:
                    free = [a for a in self.agents if not a.busy]
                    agent = rng.choice(free) if free else None
                    if agent is not None:
                        agent.busy = True
                if agent is None:
                    time.sleep(0.05)
                    continue
                try:
                    self._turn(client, agent, rng)
                finally:
                    agent.busy = False

    def _turn(self, client: httpx.Client, agent: Agent, rng: random.Random) -> None:
        user = f"Say one thing about {rng.choice(TOPICS)}."
        reply = _send(client, agent, user)
        with self.lock:
            if self.phase is not None:
                self.phase.statuses[reply.status_code] += 1
        if reply.status_code != 200:
            self.errors.append(f"{agent.name}: {reply.status_code} {reply.text[:200]}")
            return
        text = _text(agent, reply)
        agent.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]


def _send(client: httpx.Client, agent: Agent, user: str) -> httpx.Response:
    if agent.api == "openai":
        return client.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 12, "temperature": 0, "session_id": agent.name,
            "messages": [{"role": "system", "content": SYSTEM}, *agent.messages, {"role": "user", "content": user}]})
    if agent.api == "anthropic":
        return client.post("/v1/messages", headers={"x-claude-code-session-id": agent.name}, json={
            "model": "m", "max_tokens": 12, "temperature": 0, "system": SYSTEM,
            "messages": [*agent.messages, {"role": "user", "content": user}]})
    return client.post(f"/v1/agents/{agent.name}/messages", json={"content": user, "max_tokens": 12, "temperature": 0})


def _text(agent: Agent, reply: httpx.Response) -> str:
    body = reply.json()
    if agent.api == "openai":
        return body["choices"][0]["message"]["content"]
    if agent.api == "anthropic":
        return "".join(block.get("text", "") for block in body["content"])
    return body["content"]


def _sample(client: httpx.Client) -> dict:
    stats = client.get("/v1/stats").json()
    tiers = Counter(a["tier"] for a in stats["agents"])
    memory = stats["memory"]
    return {"at": time.time(), "pressure": memory["pressure"], "tiers": dict(tiers),
            "pool_used_bytes": stats["pool"]["used_bytes"], "system_used_bytes": memory["system_used_bytes"],
            "process_bytes": memory["process_bytes"], "mlx_active_bytes": memory["mlx_active_bytes"],
            "mlx_cache_bytes": memory["mlx_cache_bytes"], "soft_watermark_bytes": memory["soft_watermark_bytes"]}


def run(model: str, state_dir: Path, log_dir: Path, *, n_agents: int, threads: int, phase_s: float,
        pool_mb: float, seed: int) -> dict:
    server = Server(model, state_dir, log_dir, pool_mb, disk_mb=4096)
    server.start()
    rng = random.Random(seed)
    apis = ["direct", "openai", "anthropic"]
    agents = [Agent(f"{apis[i % 3][:2]}{uuid.uuid4().hex[:8]}", apis[i % 3]) for i in range(n_agents)]
    phases: list[Phase] = []
    tally = Tally()
    try:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            for agent in agents:
                if agent.api == "direct":
                    client.post("/v1/agents", json={"agent_id": agent.name, "system": SYSTEM}).raise_for_status()
            memory = client.get("/v1/stats").json()["memory"]
            hard = memory["hard_watermark_bytes"]
            load = Load(server.url, agents, seed)
            workers = load.run(threads)
            used = memory["system_used_bytes"]
            steps = [("normal", memory["soft_watermark_bytes"]), ("soft above use", used + GIB),
                     ("soft just under use", used - GIB // 4), ("soft 1 GiB under use", used - GIB),
                     ("soft far under use", GIB // 2), ("back to the default", memory["soft_watermark_bytes"])]
            for name, soft in steps:
                soft = max(soft, GIB // 8)
                phase = Phase(name, soft)
                phases.append(phase)
                client.put("/v1/admin/memory", json={"soft_limit_mb": soft / 2**20,
                                                     "hard_limit_mb": max(hard, soft) / 2**20}).raise_for_status()
                with load.lock:
                    load.phase = phase
                end = time.monotonic() + phase_s
                while time.monotonic() < end:
                    phase.samples.append(_sample(client))
                    time.sleep(1.0)
                print(f"{name}: soft {soft / GIB:.2f} GiB, statuses {dict(phase.statuses)}, tiers at the end "
                      f"{phase.samples[-1]['tiers']}, pool {phase.samples[-1]['pool_used_bytes'] / 2**20:.1f} MiB, "
                      f"process {phase.samples[-1]['process_bytes'] / GIB:.2f} GiB", flush=True)
            load.stop.set()
            for worker in workers:
                worker.join(300)
            listed = {a["agent_id"]: a for a in client.get("/v1/agents").json()["data"]}
            lost = [a.name for a in agents if not any(a.name in agent_id and entry["tier"] in ("hot", "cool", "warm")
                                                      for agent_id, entry in listed.items())]
            problems = []
            for agent in agents:
                agent.busy = False
                problems += _check_next_turn(client, agent, rng, tally)
    finally:
        server.kill()
    statuses = Counter()
    for phase in phases:
        statuses.update(phase.statuses)
    return {"model": model, "agents": n_agents, "threads": threads, "phase_s": phase_s, "pool_mb": pool_mb,
            "seed": seed, "statuses": dict(statuses), "server_errors": sum(n for s, n in statuses.items() if s >= 500),
            "lost_agents": lost, "next_turns_checked": tally.checked_turns, "next_turns_reused": tally.reused_turns,
            "outcomes": tally.outcomes, "not_identical": [detail for _, detail in problems],
            "load_errors": load.errors[:20],
            "phases": [{"name": p.name, "soft_watermark_bytes": p.soft_bytes, "statuses": dict(p.statuses),
                        "samples": p.samples} for p in phases]}


def main() -> None:
    from bench.bench_vs_mlx_lm_server import model_folder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a packaged model's name or a model folder")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where packaged models are imported")
    parser.add_argument("--agents", type=int, default=12, help="agents in the load (default 12)")
    parser.add_argument("--threads", type=int, default=3, help="client threads (default 3)")
    parser.add_argument("--phase-s", type=float, default=45, help="seconds per watermark step (default 45)")
    parser.add_argument("--pool-mb", type=float, default=512, help="the KV pool budget (default 512: every agent fits)")
    parser.add_argument("--seed", type=int, default=None, help="the load's seed (printed)")
    parser.add_argument("--state-dir", type=Path, default=None, help="the server's cache directory (default: a "
                        "temporary one)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    import tempfile

    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {seed}", flush=True)
    folder = model_folder(args.model, args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="semantic-memory-") as scratch:
        state = args.state_dir or Path(scratch) / "state"
        logs = Path(scratch) / "logs"
        state.mkdir(parents=True, exist_ok=True)
        logs.mkdir()
        result = run(str(folder), state, logs, n_agents=args.agents, threads=args.threads, phase_s=args.phase_s,
                     pool_mb=args.pool_mb, seed=seed)
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    ok = not result["server_errors"] and not result["lost_agents"] and not result["not_identical"]
    print("target (no 5xx, no lost agent, next turns identical):", "MET" if ok else "MISSED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
