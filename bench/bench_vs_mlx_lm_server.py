"""semantic vs mlx_lm.server: the same model folder, workloads and run, one server at a time.

A. Multi-agent multi-turn: N agents, each with its own system prompt, T turns
   each, all agents at once (one coding-agent loop per agent).
B. Many agents on a small KV budget: more agents than the KV memory holds,
   round robin. semantic moves evicted agents to its disk tier; mlx_lm.server
   drops them from its LRU prompt cache. Both get the same byte budget.
C. Concurrent throughput: 1, 4, 8 and 16 single-turn streams.

Both servers run as subprocesses and are driven by the same streaming OpenAI
chat-completions client; semantic also gets its ``session_id`` extension, the
peer reuses prefixes through its own LRU prompt cache. Each workload runs
``repeats`` times per server, the order of the two servers alternating, and
every number is the median over the repeats. Ratios are "semantic
advantage": above 1 means semantic did better, whatever the unit.

Run: ``LD_PRELOAD=... python bench/bench_vs_mlx_lm_server.py [--quick] [--workloads AB]``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from tokenizers import Tokenizer

from chat_stream import ChatClient, Turn
from common import base_parser, print_table
from comparison import Report, Row, cached_percent, cell, decode_tok_s, mean_ttft, median_of, median_ttft
from served import Batching, Launch, peer_launch, semantic_launch, serving

from engine.domain.cache_spec import DTYPE_BYTES
from engine.models.loader import resolve_model

T = TypeVar("T")
Bursts = list[list[Turn]]  # one run of workload C: the turns of each burst, in the order of Sizes.streams

BLOCK_TOKENS = 256  # semantic's default --block-tokens: its pool hands out KV memory in blocks of this many tokens
# Per turn, beyond the reply: the user message and the chat template's role markers.
TURN_OVERHEAD_TOKENS = 40
USER_TURNS = (
    "Read your rules and list the first three that apply to a bug fix.",
    "Which module does rule 2 cover, and what limit does it set?",
    "Write a one-line commit message for a fix in that module.",
    "What must you check before you push the fix?",
)
TOPICS = ("the ocean", "mountains", "a city at night", "a robot", "autumn", "a library", "trains", "the moon",
          "coffee", "a garden", "rain", "a lighthouse", "chess", "bees", "a desert", "snow")


@dataclass(frozen=True, slots=True)
class Sizes:
    agents: int
    turns: int
    system_tokens: tuple[int, int]  # A's system prompts are spread evenly over this range
    max_tokens: int
    crowd_agents: int
    crowd_turns: int
    # How many of B's agents the KV budget holds; keep it above crowd_clients, whose turns all need room at once.
    crowd_fit: int
    crowd_context: int
    crowd_clients: int  # B's requests in flight at once
    crowd_max_tokens: int
    streams: tuple[int, ...]
    stream_tokens: int
    # Runs per server and workload, alternating which server goes first so drift in the load hits both.
    repeats: int


QUICK = Sizes(
    agents=4, turns=2, system_tokens=(300, 400), max_tokens=16,
    crowd_agents=8, crowd_turns=2, crowd_fit=4, crowd_context=300, crowd_clients=2, crowd_max_tokens=8,
    streams=(1, 4, 8, 16), stream_tokens=16, repeats=1,
)
# About 25 minutes on 2 x86_64 cores with OpenBLAS (estimated from --quick); mlx_lm.server's re-prefills in B
# take about half of it. --repeats 1 halves the total.
FULL = Sizes(
    agents=8, turns=4, system_tokens=(300, 600), max_tokens=32,
    crowd_agents=16, crowd_turns=3, crowd_fit=6, crowd_context=1000, crowd_clients=4, crowd_max_tokens=16,
    streams=(1, 4, 8, 16), stream_tokens=128, repeats=2,
)


@dataclass(frozen=True, slots=True)
class Bench:
    folder: Path
    tokenizer: Tokenizer
    batching: Batching
    pool_mb: float
    work_dir: Path
    sizes: Sizes

    def semantic(self, workload: str, pool_mb: float | None = None) -> Launch:
        """semantic with its own disk tier for this workload, emptied before each run."""
        state = self.work_dir / f"semantic-{workload}"
        return semantic_launch(self.folder, state, pool_mb or self.pool_mb, self.batching)


@dataclass(frozen=True, slots=True)
class Outcome:
    wall_s: float
    turns: list[Turn]

    @property
    def first_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.index == 0]

    @property
    def later_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.index > 0]


# -- prompts and conversations ------------------------------------------------------------------
def system_prompt(tokenizer: Tokenizer, agent: int, n_tokens: int) -> str:
    """An agent's own instructions, about ``n_tokens`` long; agents differ from the first line on."""
    lines = [f"You are coding agent {agent}, working alone in the repository service-{agent}.", "House rules:"]
    while len(tokenizer.encode("\n".join(lines)).ids) < n_tokens:
        rule = len(lines) - 2
        lines.append(f"Rule {rule}: functions in module m{agent}_{rule} stay under {10 + (agent * 31 + rule * 7) % 90} "
                     f"lines, and every change there needs the test t{agent}_{rule} to pass.")
    return "\n".join(lines)


def spread(low: int, high: int, n: int) -> list[int]:
    return [low + (high - low) * i // max(n - 1, 1) for i in range(n)]


@dataclass(slots=True)
class Conversation:
    agent: str
    messages: list[dict[str, str]]

    @classmethod
    def new(cls, agent: str, system: str) -> Conversation:
        return cls(agent, [{"role": "system", "content": system}])

    async def take_turn(self, client: ChatClient, index: int, max_tokens: int) -> Turn:
        """Ask the next question and keep the reply in the history, like an agent loop does."""
        self.messages.append({"role": "user", "content": USER_TURNS[index % len(USER_TURNS)]})
        turn = await client.turn(self.agent, index, self.messages, max_tokens)
        self.messages.append({"role": "assistant", "content": turn.text})
        return turn


# -- running a workload on both servers ---------------------------------------------------------
def on_both(
    bench: Bench, launches: tuple[Launch, Launch], work: Callable[[ChatClient], Awaitable[T]]
) -> tuple[list[T], list[T]]:
    """Every run of ``work`` on semantic and on the peer: one server at a time, they would share the cores."""
    runs: dict[str, list[T]] = {launch.name: [] for launch in launches}
    for repeat in range(bench.sizes.repeats):
        for launch in launches if repeat % 2 == 0 else launches[::-1]:
            flags = launch.flags().replace(str(bench.folder), "<model>")
            print(f"# run {repeat + 1}, {launch.name} {_load()}: {flags}", flush=True)
            with serving(launch, bench.work_dir) as url:
                runs[launch.name].append(asyncio.run(_drive(url, launch, work)))
    return runs[launches[0].name], runs[launches[1].name]


async def _drive(url: str, launch: Launch, work: Callable[[ChatClient], Awaitable[T]]) -> T:
    async with ChatClient(url, launch.sends_session_id) as client:
        return await work(client)


# -- metrics of the multi-turn workloads ------------------------------------------------------
def generated_tok_s(outcome: Outcome) -> float:
    return sum(t.completion_tokens for t in outcome.turns) / outcome.wall_s


# (metric, measure, lower is better) for the multi-turn workloads A and B.
CONVERSATION_METRICS: list[tuple[str, Callable[[Outcome], float | None], bool]] = [
    ("total wall s", lambda o: o.wall_s, True),
    ("TTFT turn 1 mean s", lambda o: mean_ttft(o.first_turns), True),
    ("TTFT turns 2+ mean s", lambda o: mean_ttft(o.later_turns), True),
    ("TTFT turns 2+ median s", lambda o: median_ttft(o.later_turns), True),
    ("generated tok/s", generated_tok_s, False),
    ("turns 2+ prompt cached %", lambda o: cached_percent(o.later_turns), False),
]


def conversation_rows(ours: list[Outcome], theirs: list[Outcome]) -> list[Row]:
    return [Row(name, median_of(measure, ours), median_of(measure, theirs), lower)
            for name, measure, lower in CONVERSATION_METRICS]


def all_turns(runs: list[Outcome]) -> list[Turn]:
    return [t for run in runs for t in run.turns]


# -- A: multi-agent multi-turn ------------------------------------------------------------------
def multi_agent(bench: Bench, report: Report) -> None:
    s = bench.sizes
    low, high = s.system_tokens
    print(f"\n## A. {s.agents} agents x {s.turns} turns, all agents at once, own system prompts of {low}-{high} "
          f"tokens, {s.max_tokens} tokens per reply")
    systems = [system_prompt(bench.tokenizer, i, n) for i, n in enumerate(spread(low, high, s.agents))]
    # Enough entries that the peer's LRU never evicts here: A is about reuse, B about eviction.
    launches = (bench.semantic("a"), peer_launch(bench.folder, bench.batching, cache_entries=4 * s.agents))

    async def work(client: ChatClient) -> Outcome:
        conversations = [Conversation.new(f"agent-{i}", system) for i, system in enumerate(systems)]
        t0 = time.perf_counter()
        per_agent = await asyncio.gather(*(_agent_loop(c, client, s.turns, s.max_tokens) for c in conversations))
        return Outcome(time.perf_counter() - t0, [t for turns in per_agent for t in turns])

    ours, theirs = on_both(bench, launches, work)
    rows = conversation_rows(ours, theirs)
    report.table("A multi-turn", rows, ("total wall s", "TTFT turns 2+ mean s", "generated tok/s"))
    report.notes.append(greedy_match(ours[0], theirs[0]))
    print(report.notes[-1])
    report.note_retries("A", all_turns(ours), all_turns(theirs))


async def _agent_loop(conversation: Conversation, client: ChatClient, turns: int, max_tokens: int) -> list[Turn]:
    return [await conversation.take_turn(client, index, max_tokens) for index in range(turns)]


def greedy_match(ours: Outcome, theirs: Outcome) -> str:
    """Same model, same template, greedy: any difference points at a template or tokenizer gap."""
    peer_text = {(t.agent, t.index): t.text for t in theirs.turns}
    first = [t for t in ours.first_turns if peer_text.get((t.agent, 0)) == t.text]
    every = [t for t in ours.turns if peer_text.get((t.agent, t.index)) == t.text]
    line = (f"greedy outputs identical (A): first turns {len(first)}/{len(ours.first_turns)}, "
            f"all turns {len(every)}/{len(ours.turns)}")
    differing = [t for t in ours.turns if peer_text.get((t.agent, t.index)) != t.text]
    if differing:
        t = differing[0]
        line += (f"\n  first difference, {t.agent} turn {t.index + 1}:\n  semantic:      {t.text!r}"
                 f"\n  mlx_lm.server: {peer_text.get((t.agent, t.index))!r}")
    return line


# -- B: many agents, small KV budget ------------------------------------------------------------
def crowded(bench: Bench, report: Report) -> None:
    s = bench.sizes
    agent_tokens = s.crowd_context + s.crowd_turns * (s.crowd_max_tokens + TURN_OVERHEAD_TOKENS)
    budget = s.crowd_fit * kv_bytes(bench.folder, agent_tokens)
    print(f"\n## B. {s.crowd_agents} agents x {s.crowd_turns} turns, round robin with {s.crowd_clients} in flight, "
          f"KV budget {budget / 2**20:.1f} MiB (~{s.crowd_fit} agents of ~{agent_tokens} tokens)")
    systems = [system_prompt(bench.tokenizer, i, s.crowd_context) for i in range(s.crowd_agents)]
    # The bytes must be what binds the peer, not its entry count: a chat's system-prompt segment is an
    # entry of its own until the finished turn replaces it.
    peer = peer_launch(bench.folder, bench.batching, cache_entries=2 * s.crowd_agents, cache_bytes=budget)
    launches = (bench.semantic("b", budget / 2**20), peer)

    async def work(client: ChatClient) -> Outcome:
        conversations = [Conversation.new(f"crowd-{i}", system) for i, system in enumerate(systems)]
        gate = asyncio.Semaphore(s.crowd_clients)
        t0 = time.perf_counter()
        turns: list[Turn] = []
        for index in range(s.crowd_turns):
            turns += await asyncio.gather(*(_gated(gate, c.take_turn(client, index, s.crowd_max_tokens))
                                            for c in conversations))
        return Outcome(time.perf_counter() - t0, turns)

    ours, theirs = on_both(bench, launches, work)
    report.table("B small KV budget", conversation_rows(ours, theirs),
                 ("total wall s", "TTFT turns 2+ mean s", "turns 2+ prompt cached %"))
    report.note_retries("B", all_turns(ours), all_turns(theirs))


async def _gated(gate: asyncio.Semaphore, turn: Awaitable[Turn]) -> Turn:
    async with gate:
        return await turn


def kv_bytes(folder: Path, n_tokens: int) -> int:
    """KV bytes of one agent of ``n_tokens`` in whole blocks (uniform full-attention models such as SmolLM2)."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    dtype = DTYPE_BYTES[config.get("torch_dtype", "float32")]
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype
    return math.ceil(n_tokens / BLOCK_TOKENS) * BLOCK_TOKENS * per_token


# -- C: concurrent throughput -------------------------------------------------------------------
def throughput(bench: Bench, report: Report) -> None:
    s = bench.sizes
    print(f"\n## C. Concurrent single-turn streams, {s.stream_tokens} tokens each: decode tok/s")
    launches = (bench.semantic("c"), peer_launch(bench.folder, bench.batching, cache_entries=10))

    async def work(client: ChatClient) -> Bursts:
        return [await _burst(client, n, s.stream_tokens) for n in s.streams]

    ours, theirs = on_both(bench, launches, work)
    rows = [Row(f"decode tok/s, {n} streams", *burst_medians(decode_tok_s, level, ours, theirs), lower_is_better=False)
            for level, n in enumerate(s.streams)]
    ttft_rows = [Row(f"TTFT mean s, {n} streams", *burst_medians(mean_ttft, level, ours, theirs))
                 for level, n in enumerate(s.streams)]
    print_table(["streams", "semantic tok/s", "mlx_lm.server tok/s", "semantic advantage x", "semantic TTFT s",
                 "mlx_lm.server TTFT s"],
                [[n, cell(r.semantic), cell(r.peer), cell(r.advantage), cell(t.semantic), cell(t.peer)]
                 for n, r, t in zip(s.streams, rows, ttft_rows, strict=True)])
    report.highlights += [("C throughput", r) for r in rows]
    report.note_retries("C", _flat(ours), _flat(theirs))


def burst_medians(
    measure: Callable[[list[Turn]], float | None], level: int, ours: list[Bursts], theirs: list[Bursts]
) -> tuple[float | None, float | None]:
    """``measure`` of the ``level``-th burst, median over each server's runs."""
    return median_of(lambda run: measure(run[level]), ours), median_of(lambda run: measure(run[level]), theirs)


def _flat(runs: list[Bursts]) -> list[Turn]:
    return [t for run in runs for burst in run for t in burst]


async def _burst(client: ChatClient, n_streams: int, max_tokens: int) -> list[Turn]:
    """``n_streams`` requests at once, each prompt new to both servers so no cache serves it."""
    return await asyncio.gather(*(client.turn(f"stream-{n_streams}-{i}", 0, _story(n_streams, i), max_tokens)
                                  for i in range(n_streams)))


def _story(n_streams: int, i: int) -> list[dict[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Story {n_streams}-{i}: write a long story about {topic}."}]


# -- main ---------------------------------------------------------------------------------------
WORKLOADS: dict[str, Callable[[Bench, Report], None]] = {"A": multi_agent, "B": crowded, "C": throughput}


def _load() -> str:
    # Other processes on a 2-core box skew every number: say how busy it was.
    return f"(load average {os.getloadavg()[0]:.2f})"


def model_folder(ref: str, cache_dir: Path) -> Path:
    resolved = resolve_model(ref, cache_dir)
    if not resolved.is_local:
        raise SystemExit(f"{ref!r} is a hub id; both servers need the same local MLX folder")
    return Path(resolved.location)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="ABC", help="which workloads to run, e.g. AC (default: ABC)")
    parser.add_argument("--repeats", type=int, help="runs per server and workload (default: 1 quick, 2 full)")
    args = parser.parse_args()
    folder = model_folder(args.model, args.cache_dir)
    sizes = QUICK if args.quick else FULL
    if args.repeats:
        sizes = replace(sizes, repeats=args.repeats)
    print(f"# model folder {folder}\n# {'quick' if args.quick else 'full'} sizes: {sizes}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-vs-mlx-lm-") as work:
        bench = Bench(folder, Tokenizer.from_file(str(folder / "tokenizer.json")), Batching(), args.pool_mb,
                      Path(work), sizes)
        report = Report()
        for letter in args.workloads.upper():
            WORKLOADS[letter](bench, report)
        report.summary()
    print(f"# finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
