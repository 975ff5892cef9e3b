"""Crash consistency: kill `semantic --serve` with SIGKILL at random moments under load, restart it, check.

Each round starts the server on the same state directory (a small pool and a small disk budget, so evictions,
spills and shared prefixes happen all the time), runs a steady load on it from a few client threads, kills it
with SIGKILL at a random moment, and checks what the restart finds. The load, all greedy:

- turns of direct agents (``POST /v1/agents/{id}/messages``: the server keeps their conversations), OpenAI
  chat agents (``session_id``) and Anthropic agents (Claude Code's session header), every agent on the same
  long system prompt (a shared prefix);
- forks and rewinds of direct agents, evictions to warm and cold, evict-idle, exports and imports;
- now and then a model swap to the same model (``POST /v1/admin/swap``): every hot agent is spilled to disk,
  the model unloaded and loaded again, and a kill may land in any of those phases.

``--kv-bits-at-rest 8`` (or 4) runs the server with idle agents quantized at rest (the cool tier, and warm
files written quantized): every check holds but one, a turn that reused a quantized cache may differ from the
fresh prefill by design; such differences are counted (``approximate``), not violations. A turn that reused
nothing must still be token-identical.

After every restart:

- the server starts by itself (no manual cleanup) and is ready;
- no temporary file survives the start-up sweep (``*.tmp``, unfinished exports and imports);
- every agent file in the warm tier is an agent the server lists as warm (or a stored prefix), and every
  agent it lists as warm has its file; the warm tier is within its disk budget;
- a direct agent's stored conversation holds every turn its client got an answer for (a turn in flight at the
  kill may be there or not; the harness rewinds such an agent to what it knows);
- the next turn of a sample of agents is token-identical to a fresh prefill of the same conversation (a new
  agent, greedy), whether its cache was reused or had to be rebuilt: the turn's cache outcome is recorded. A
  turn the full pool ended early says so (finish ``capacity``) and is counted (``capacity_cut``), not compared.

Every violation is printed with the round and the seed; ``--seed S --rounds N`` replays a run. Exit status 1
on any violation.

Run: ``LD_PRELOAD=... python -m bench.crash --model smollm2-135m --rounds 200 --json crash.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.served import free_port, server_env  # noqa: E402
from engine.api.identity import prefix_hash  # noqa: E402
from engine.domain.chat import ChatMessage, Conversation  # noqa: E402

SYSTEM = ("You are a terse assistant for a team of engineers. Answer in one short sentence. "
          "Prefer plain words. Never use lists. " * 3).strip()
TOPICS = ["rivers", "bread", "comets", "glass", "trains", "owls", "salt", "bridges", "tea", "maps", "clocks",
          "copper", "tides", "paper", "bees", "ice"]
ANTHROPIC_PREFIX = prefix_hash(Conversation((ChatMessage("system", SYSTEM),)))
READY_TIMEOUT_S = 300.0
TURN_TOKENS = 12  # each turn's max_tokens: short turns, many of them
CHECKED_PER_ROUND = 3  # agents whose next turn is compared with a fresh prefill after each restart
AGENTLESS = ("evict_idle", "swap")  # load actions on no agent in particular


@dataclass
class Agent:
    """What the harness knows of one agent: only what the server acknowledged."""

    name: str  # direct: the agent id; openai: the session id; anthropic: the Claude Code session id
    api: str  # direct | openai | anthropic
    messages: list[dict[str, str]] = field(default_factory=list)  # user/assistant, acknowledged
    busy: bool = False
    # An operation was in flight when the server died: the server may hold one more turn (or a rewind).
    in_flight: str | None = None

    @property
    def agent_id(self) -> str:
        """The server's id of the agent (engine/api/identity.py)."""
        if self.api == "openai":
            return f"oa-{self.name}"
        if self.api == "anthropic":
            return f"cc-{self.name}-{ANTHROPIC_PREFIX[:8]}"
        return self.name


@dataclass
class Violation:
    round: int
    check: str
    detail: str


@dataclass
class Tally:
    rounds: int = 0
    actions: dict[str, int] = field(default_factory=dict)
    checked_turns: int = 0
    reused_turns: int = 0  # of those, how many reused a cache
    approximate: int = 0  # with KV quantized at rest: reused turns that differed from the fresh prefill
    capacity_cut: int = 0  # turns the full pool ended early (finish "capacity"): not comparable token for token
    set_apart: list[str] = field(default_factory=list)  # what each capacity cut or approximate turn was
    outcomes: dict[str, int] = field(default_factory=dict)
    restart_s: list[float] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)

    def count(self, action: str) -> None:
        self.actions[action] = self.actions.get(action, 0) + 1


class Server:
    """One ``semantic --serve`` process on the state directory; killed with SIGKILL, never stopped politely."""

    def __init__(self, model: str, state_dir: Path, log_dir: Path, pool_mb: float, disk_mb: float,
                 kv_bits: int | None = None) -> None:
        self.model, self.state_dir, self.log_dir = model, state_dir, log_dir
        self.pool_mb, self.disk_mb, self.kv_bits = pool_mb, disk_mb, kv_bits
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.starts = 0

    def start(self) -> float:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.starts += 1
        argv = [sys.executable, "-m", "semantic_cli", "--serve", "--model", self.model,
                "--cache-dir", str(self.state_dir), "--pool-budget-mb", f"{self.pool_mb:g}",
                "--disk-budget-mb", f"{self.disk_mb:g}", "--block-tokens", "16", "--port", str(port),
                "--log-level", "warning", "--no-persist-on-exit"]
        if self.kv_bits is not None:
            argv += ["--kv-bits-at-rest", str(self.kv_bits)]
        log = open(self.log_dir / f"server-{self.starts:04d}.log", "wb")
        started = time.monotonic()
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                        env={**server_env(), "OPENBLAS_NUM_THREADS": "1"})
        log.close()
        deadline = started + READY_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.process.returncode} at start "
                                       f"(log {self.log_dir / f'server-{self.starts:04d}.log'})")
                with suppress(httpx.TransportError):
                    if client.get("/health/ready").status_code == 200:
                        return time.monotonic() - started
                time.sleep(0.2)
        raise TimeoutError(f"the server was not ready after {READY_TIMEOUT_S:.0f} s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)


def start_workers(worker: Callable[[random.Random], None], rng: random.Random, threads: int) -> list[threading.Thread]:
    """``threads`` daemon threads running ``worker``, each with a random generator of its own drawn from ``rng``
    (so a seed replays the same choices)."""
    workers = [threading.Thread(target=worker, args=(random.Random(rng.random()),), daemon=True)
               for _ in range(threads)]
    for thread in workers:
        thread.start()
    return workers


class Load:
    """Client threads doing random work on the agents until stopped; only acknowledged results are kept."""

    def __init__(self, url: str, agents: dict[str, Agent], exports: dict[str, tuple[bytes, Agent]],
                 rng: random.Random, tally: Tally, model: str = "") -> None:
        self.url, self.agents, self.exports, self.rng, self.tally = url, agents, exports, rng, tally
        self.model = model  # what a swap swaps to (the model already loaded; "": no swaps)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[str] = []

    def run(self, threads: int) -> list[threading.Thread]:
        return start_workers(self._worker, self.rng, threads)

    def _worker(self, rng: random.Random) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                action, agent = self._pick(rng)
                if agent is None and action not in AGENTLESS:
                    time.sleep(0.01)
                    continue
                try:
                    self._do(client, action, agent, rng)
                except (httpx.TransportError, httpx.TimeoutException):
                    return  # the server died: what was in flight stays marked (agent.in_flight)
                finally:
                    if agent is not None:
                        with self.lock:
                            agent.busy = False

    def _pick(self, rng: random.Random) -> tuple[str, Agent | None]:
        action = rng.choices(["turn", "new", "evict", "fork", "rewind", "export", "import", "evict_idle", "swap"],
                             [50, 8, 10, 6, 5, 6, 5, 2, 1 if self.model else 0])[0]
        with self.lock:
            if action == "new" or not self.agents:
                api = rng.choice(["direct", "openai", "anthropic"])
                agent = Agent(f"{api[:2]}{uuid.uuid4().hex[:8]}", api, busy=True)
                agent.in_flight = "create"
                self.agents[agent.name] = agent
                return "new", agent
            if action in AGENTLESS:
                return action, None
            wanted = {"fork": "direct", "rewind": "direct", "import": None}.get(action)
            free = [a for a in self.agents.values() if not a.busy and a.in_flight is None
                    and (wanted is None or a.api == wanted)]
            if action == "import" and not self.exports:
                return action, None
            if not free:
                return action, None
            agent = rng.choice(free)
            agent.busy = True
            agent.in_flight = action
            return action, agent

    def _do(self, client: httpx.Client, action: str, agent: Agent | None, rng: random.Random) -> None:
        if action == "evict_idle":
            client.post("/v1/admin/evict-idle")
        elif action == "swap":
            # 202 while it runs; 503 when one already runs: either way the load goes on and waits at the gate.
            reply = client.post("/v1/admin/swap", json={"model": self.model})
            if not self._ok(reply, "swap"):
                return
        elif action == "new":
            assert agent is not None
            if agent.api == "direct":
                if not self._ok(client.post("/v1/agents", json={"agent_id": agent.name, "system": SYSTEM}),
                                "create"):
                    with self.lock:
                        del self.agents[agent.name]
                    return
            agent.in_flight = "turn"  # created (acknowledged): from here on it must survive
            self._turn(client, agent, rng)
        elif action == "turn":
            assert agent is not None
            self._turn(client, agent, rng)
        elif action == "evict":
            assert agent is not None
            client.post(f"/v1/agents/{agent.agent_id}/evict", json={"tier": rng.choice(["warm", "cold"])})
        elif action == "fork":
            assert agent is not None
            child = Agent(f"fk{uuid.uuid4().hex[:8]}", "direct", list(agent.messages))
            if self._ok(client.post(f"/v1/agents/{agent.name}/fork", json={"name": child.name}), "fork"):
                with self.lock:
                    self.agents[child.name] = child
        elif action == "rewind":
            assert agent is not None
            turn = rng.randint(0, len(agent.messages) // 2)
            if self._ok(client.post(f"/v1/agents/{agent.name}/rewind", json={"turn": turn}), "rewind"):
                agent.messages = agent.messages[:2 * turn]
        elif action == "export":
            assert agent is not None
            reply = client.get(f"/v1/agents/{agent.agent_id}/export")
            if reply.status_code == 200:
                with self.lock:
                    self.exports[agent.name] = (reply.content, Agent(agent.name, agent.api, list(agent.messages)))
        elif action == "import":
            assert agent is not None
            with self.lock:
                key = rng.choice(sorted(self.exports))
                blob, snapshot = self.exports[key]
            child = Agent(f"im{uuid.uuid4().hex[:8]}", "direct" if snapshot.api == "direct" else "openai",
                          list(snapshot.messages))
            reply = client.post("/v1/agents/import", params={"as": child.agent_id}, content=blob,
                                headers={"content-type": "application/octet-stream"})
            if self._ok(reply, "import", also=(409,)) and reply.status_code == 201:
                with self.lock:
                    self.agents[child.name] = child
        assert action in AGENTLESS or agent is not None
        self.tally.count(action)
        if agent is not None:
            agent.in_flight = None

    def _turn(self, client: httpx.Client, agent: Agent, rng: random.Random) -> None:
        user = f"Say one thing about {rng.choice(TOPICS)}."
        reply = send_turn(client, agent, user)
        if reply is not None:
            agent.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]

    def _ok(self, reply: httpx.Response, what: str, also: tuple[int, ...] = ()) -> bool:
        if reply.status_code < 300:
            return True
        if reply.status_code in (*also, 409, 429, 503):
            return False  # busy, no room now, exists: the server said so cleanly
        self.errors.append(f"{what}: {reply.status_code} {reply.text[:200]}")
        return False


def send_turn(client: httpx.Client, agent: Agent, user: str, fresh: bool = False,
              details: dict[str, Any] | None = None) -> str | None:
    """One greedy turn of ``agent`` (``fresh``: the same conversation as a brand-new OpenAI agent instead).
    The reply's text, or None when the server refused it cleanly (busy, no room). ``details`` gets why the
    reply ended and its token counts (what a divergence report needs)."""
    if fresh or agent.api == "openai":
        session = f"ref{uuid.uuid4().hex[:10]}" if fresh else agent.name
        reply = client.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": TURN_TOKENS, "temperature": 0, "session_id": session,
            "messages": [{"role": "system", "content": SYSTEM}, *agent.messages, {"role": "user", "content": user}]})
        if fresh and reply.status_code == 200:
            client.delete(f"/v1/agents/oa-{session}")
        if reply.status_code != 200:
            return _refused(reply)
        body = reply.json()
        _note(details, body["choices"][0].get("finish_reason"), body.get("usage"))
        return body["choices"][0]["message"]["content"]
    if agent.api == "anthropic":
        reply = client.post("/v1/messages", headers={"x-claude-code-session-id": agent.name}, json={
            "model": "m", "max_tokens": TURN_TOKENS, "temperature": 0, "system": SYSTEM,
            "messages": [*agent.messages, {"role": "user", "content": user}]})
        if reply.status_code == 200:
            body = reply.json()
            _note(details, body.get("stop_reason"), body.get("usage"))
            return "".join(block.get("text", "") for block in body["content"])
        return _refused(reply)
    reply = client.post(f"/v1/agents/{agent.name}/messages", json={"content": user, "max_tokens": TURN_TOKENS,
                                                                    "temperature": 0})
    if reply.status_code != 200:
        return _refused(reply)
    body = reply.json()
    _note(details, body.get("finish_reason"), body.get("usage"))
    return body["content"]


def _note(details: dict[str, Any] | None, finish: Any, usage: Any) -> None:
    if details is not None:
        details.update(finish=finish, usage={k: v for k, v in (usage or {}).items() if not isinstance(v, dict)})


def _refused(reply: httpx.Response) -> None:
    if reply.status_code in (409, 429, 503, 529):
        return None
    raise RuntimeError(f"turn failed: {reply.status_code} {reply.text[:300]}")


# -- checks after a restart --------------------------------------------------------------------------------------
def check_restart(server: Server, agents: dict[str, Agent], rng: random.Random, round_no: int,
                  tally: Tally) -> None:
    problems: list[tuple[str, str]] = []
    # A temp file of the restarted server itself is a write in progress (its first budget pass rewrites the
    # cold index, say), not a leftover: only a dead writer's count.
    live = server.process.pid if server.process is not None else None
    temps = [p for p in server.state_dir.rglob("*") if p.is_file() and _is_temp(p.name, live)]
    if temps:
        problems.append(("temp files", ", ".join(str(p.relative_to(server.state_dir)) for p in temps[:8])))
    with httpx.Client(base_url=server.url, timeout=300) as client:
        listed = {a["agent_id"]: a for a in client.get("/v1/agents").json()["data"]}
        problems += _check_warm_files(server, listed)
        for agent in list(agents.values()):
            found, keep = _settle(client, agent, listed)
            problems += found
            if not keep:
                del agents[agent.name]
        candidates = [a for a in agents.values() if a.in_flight is None]
        for agent in rng.sample(candidates, min(CHECKED_PER_ROUND, len(candidates))):
            problems += _check_next_turn(client, agent, rng, tally, server.kv_bits)
    for check, detail in problems:
        tally.violations.append(Violation(round_no, check, detail))


def _is_temp(name: str, live_pid: int | None) -> bool:
    from engine.store.temp_files import TEMP_NAME

    match = TEMP_NAME.fullmatch(name)
    if match is not None and live_pid is not None and int(match["pid"]) == live_pid:
        return False
    return name.endswith(".tmp") or match is not None


def _check_warm_files(server: Server, listed: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """The warm tier's files against the server's list: a warm agent has its file, a file has its agent (or is
    a stored shared prefix), and all of them fit the disk budget."""
    from engine.store.cache_file import SUFFIX
    from engine.store.file_names import agent_file_stem

    problems = []
    files = [p for p in server.state_dir.rglob(f"*{SUFFIX}") if not p.name.startswith(".")
             and "quarantine" not in p.parts and "models" not in p.parts]
    warm_bytes = sum(p.stat().st_size for p in files)
    if warm_bytes > server.disk_mb * 2**20:
        problems.append(("disk budget", f"{warm_bytes / 2**20:.1f} MiB of cache files over {server.disk_mb} MiB"))
    agent_files = {p.name[:-len(SUFFIX)]: p for p in files if "prefixes" not in p.parts}
    warm = {agent_file_stem(agent_id): agent_id for agent_id, agent in listed.items() if agent["tier"] == "warm"}
    for stem, agent_id in warm.items():
        if stem not in agent_files:
            problems.append(("warm index", f"{agent_id} is listed warm but has no file"))
    for stem, path in agent_files.items():
        if stem not in warm:
            problems.append(("warm index", f"{path.relative_to(server.state_dir)} is no warm agent's file"))
    return problems


def _settle(client: httpx.Client, agent: Agent,
            listed: dict[str, dict[str, Any]]) -> tuple[list[tuple[str, str]], bool]:
    """Bring the harness's idea of ``agent`` in line with what survived: (violations, whether to keep it).

    A direct agent whose creation was acknowledged must exist, with every acknowledged turn; one more turn (in
    flight at the kill) may be there too, and a rewind in flight may or may not have happened: the harness
    rewinds the agent to what it knows. The other APIs' clients send the whole conversation each turn, so
    whatever their agents' caches hold, the next turn's prompt is what the harness knows.
    """
    in_flight, agent.in_flight, agent.busy = agent.in_flight, None, False
    if agent.api != "direct":
        return [], True
    known = len(agent.messages)
    stored = listed.get(agent.name, {}).get("messages")
    if stored is None:
        if in_flight == "create":
            return [], False  # never acknowledged
        return [("lost agent", f"direct agent {agent.name} ({known} messages acknowledged) is gone")], False
    if stored < known and in_flight != "rewind":
        return [("lost turn", f"{agent.name}: {known} messages acknowledged, {stored} stored")], True
    if stored != known:
        reply = client.post(f"/v1/agents/{agent.name}/rewind", json={"turn": min(known, stored) // 2})
        if reply.status_code != 200:
            return [("rewind", f"{agent.name}: {reply.status_code} {reply.text[:200]}")], False
        agent.messages = agent.messages[:min(known, stored)]
    return [], True


def _check_next_turn(client: httpx.Client, agent: Agent, rng: random.Random, tally: Tally,
                     kv_bits: int | None = None) -> list[tuple[str, str]]:
    user = f"And one more thing about {rng.choice(TOPICS)}?"
    history = list(agent.messages)  # the conversation before this turn: what the fresh prefill is given
    mine: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    try:
        reply = send_turn(client, agent, user, details=mine)
        reference = send_turn(client, Agent(agent.name, agent.api, history), user, fresh=True, details=theirs)
    except RuntimeError as exc:
        return [("next turn", f"{agent.name}: {exc}")]
    if reply is None or reference is None:
        return []
    tally.checked_turns += 1
    found = client.get(f"/v1/agents/{agent.agent_id}")
    view = found.json() if found.status_code == 200 else {}
    mine.update(last_finish=view.get("last_finish"), last_finish_note=view.get("last_finish_note"))
    history = view.get("cache_history") or [{}]
    outcome = history[-1].get("outcome", "unknown")
    tally.outcomes[outcome] = tally.outcomes.get(outcome, 0) + 1
    if history[-1].get("reused_tokens"):
        tally.reused_turns += 1
    agent.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    if reply == reference:
        return []
    detail = (f"{agent.name} ({agent.api}, cache outcome {outcome}): {reply!r} ({mine}) against a fresh "
              f"prefill's {reference!r} ({theirs})")
    if mine.get("last_finish") == "capacity":
        tally.capacity_cut += 1  # the pool could not grow the turn: it says why, and ends short of the reference
        tally.set_apart.append(f"capacity cut: {detail}")
        return []
    if kv_bits is not None and history[-1].get("reused_tokens"):
        tally.approximate += 1  # a cache quantized at rest is close to a fresh prefill's, not equal
        tally.set_apart.append(f"approximate: {detail}")
        return []
    return [("not token-identical", detail)]


# -- rounds ---------------------------------------------------------------------------------------------------
def run(model: str, rounds: int, seed: int, state_dir: Path, log_dir: Path, *, pool_mb: float = 24,
        disk_mb: float = 64, threads: int = 3, kill_after: tuple[float, float] = (1.0, 8.0),
        progress: Callable[[str], None] = print, after_kill: Callable[[int, Path], None] | None = None,
        max_minutes: float | None = None, swaps: bool = True, kv_bits: int | None = None) -> Tally:
    """``rounds`` kill-and-restart rounds (fewer when ``max_minutes`` runs out first; ``tally.rounds`` says how
    many ran); ``after_kill(round, state_dir)`` runs between a kill and the restart (the suite plants a dead
    writer's temporary files there); ``swaps``: whether the load swaps the model now and then; ``kv_bits``: idle
    agents' KV quantized at rest to that many bits."""
    deadline = time.monotonic() + max_minutes * 60 if max_minutes else None
    rng = random.Random(seed)
    tally = Tally()
    agents: dict[str, Agent] = {}
    exports: dict[str, tuple[bytes, Agent]] = {}
    server = Server(model, state_dir, log_dir, pool_mb, disk_mb, kv_bits)
    server.start()
    set_apart_seen = 0
    try:
        for round_no in range(1, rounds + 1):
            if deadline is not None and time.monotonic() > deadline:
                progress(f"stopping after {round_no - 1} rounds: --max-minutes {max_minutes:g} ran out")
                break
            load = Load(server.url, agents, exports, rng, tally, model if swaps else "")
            workers = load.run(threads)
            time.sleep(rng.uniform(*kill_after))
            server.kill()
            load.stop.set()
            for worker in workers:
                worker.join(60)
            for error in load.errors:
                tally.violations.append(Violation(round_no, "request", error))
            if after_kill is not None:
                after_kill(round_no, state_dir)
            try:
                tally.restart_s.append(server.start())
            except (RuntimeError, TimeoutError) as exc:
                tally.violations.append(Violation(round_no, "restart", str(exc)))
                raise
            check_restart(server, agents, rng, round_no, tally)
            tally.rounds = round_no
            bad = [v for v in tally.violations if v.round == round_no]
            progress(f"round {round_no}/{rounds} (seed {seed}): {len(agents)} agents, restart "
                     f"{tally.restart_s[-1]:.1f} s, {tally.checked_turns} turns checked, "
                     f"{'OK' if not bad else f'{len(bad)} VIOLATION(S): ' + '; '.join(v.check for v in bad)}")
            for violation in bad:
                progress(f"  round {violation.round} {violation.check}: {violation.detail}")
            for note in tally.set_apart[set_apart_seen:]:
                progress(f"  round {round_no} set apart, {note}")
            set_apart_seen = len(tally.set_apart)
    finally:
        server.kill()
    return tally


def main() -> None:
    from bench.bench_vs_mlx_lm_server import model_folder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a packaged model's name or a model folder")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where packaged models are imported")
    parser.add_argument("--rounds", type=int, default=200, help="kill-and-restart rounds (default 200)")
    parser.add_argument("--seed", type=int, default=None, help="the run's seed (printed; replays a run)")
    parser.add_argument("--pool-mb", type=float, default=24, help="the server's KV pool budget (small: evictions)")
    parser.add_argument("--disk-mb", type=float, default=64, help="the warm tier's disk budget")
    parser.add_argument("--threads", type=int, default=3, help="client threads of the load")
    parser.add_argument("--max-minutes", type=float, help="start no round after this long (the tally says how "
                                                          "many rounds ran)")
    parser.add_argument("--no-swaps", action="store_true", help="leave model swaps out of the load")
    parser.add_argument("--kv-bits-at-rest", type=int, choices=(8, 4), help="quantize idle agents' KV at rest "
                        "(the server's --kv-bits-at-rest); a reused quantized cache may then differ from a fresh "
                        "prefill (counted as approximate)")
    parser.add_argument("--json", type=Path, help="write the tally here")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary folder, "
                                                  "kept only when a round fails)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    folder = model_folder(args.model, args.cache_dir)
    print(f"# crash harness: model {folder}, {args.rounds} rounds, seed {seed}")
    import shutil
    import tempfile

    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="semantic-crash-"))
    state, logs = scratch / "state", scratch / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        tally = run(str(folder), args.rounds, seed, state, logs, pool_mb=args.pool_mb, disk_mb=args.disk_mb,
                    threads=args.threads, max_minutes=args.max_minutes, swaps=not args.no_swaps,
                    kv_bits=args.kv_bits_at_rest)
    except BaseException:
        print(f"# stopped; the state directory and the server logs are kept in {scratch}")
        raise
    if tally.violations or args.keep:
        print(f"# the state directory and the server logs are kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {"model": args.model, "rounds": tally.rounds, "rounds_asked": args.rounds, "seed": seed,
               "actions": tally.actions,
               "swaps": not args.no_swaps, "kv_bits_at_rest": args.kv_bits_at_rest,
               "checked_turns": tally.checked_turns, "reused_turns": tally.reused_turns,
               "approximate": tally.approximate, "capacity_cut": tally.capacity_cut, "set_apart": tally.set_apart,
               "outcomes": tally.outcomes, "violations": [v.__dict__ for v in tally.violations],
               "restart_s_median": sorted(tally.restart_s)[len(tally.restart_s) // 2] if tally.restart_s else None,
               "minutes": round((time.monotonic() - started) / 60, 1)}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    sys.exit(1 if tally.violations else 0)


if __name__ == "__main__":
    main()
