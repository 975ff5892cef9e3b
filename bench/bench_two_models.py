"""Two models, many agents: one semantic server holding both against one mlx_lm.server per model.

The workload: ``--agents`` agents on each model, all at once, each taking
``--turns`` turns in order (its next turn follows its last answer); the
agents of one model share a system prompt, then each sends its own tool
results. semantic runs as users start it for this, ``semantic --serve
--model LARGE --extra-model small=SMALL`` (its default budgets), and its
clients name the model per request (``model: "small"`` for the small
model's agents, nothing for the default). The peer is what a user runs
without it: two ``mlx_lm.server --model FOLDER`` processes at their
defaults, one per model, on the same two cores at the same time.

Reported per run: the wall time of the whole workload, TTFT p50/p95 over
every turn and per model, and peak memory: semantic's process against the
sum of the two peers' peaks. Each server set is started fresh and warmed up
on both models before the clock starts; ``--repeats`` runs each, the order
alternating. Target (issue 51): at least 1.5x the peers' wall time, and
less memory than their sum.

``--workloads trace`` replays Claude Code as it runs with a side model: the
recorded ``--bare`` session (bench/traces/claude_code_bare.jsonl, two main
turns) and three recorded haiku-tier requests (``claude --bare --model haiku
-p ...``, claude_code_haiku_side.jsonl), all sessions at once, back to back.
Against semantic with Gemma 3 alone (every request on it) and with SmolLM2
beside it as the ``side`` model (``--extra-model small=...,side``: the haiku
requests go there): each main turn's TTFT and each side request's whole
latency, both servers started fresh and warmed, order alternating.

Gemma 3 270M ships without a chat template: semantic renders its plain
``User:``/``Assistant:`` format, mlx_lm.server its own fallback (``USER:``),
so the two see slightly different prompt tokens for the same messages.

Run: ``LD_PRELOAD=... python -m bench.bench_two_models [--quick] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer

from bench.bench_vs_mlx_lm_server import model_folder
from bench.chat_stream import ChatClient, Turn
from bench.common import base_parser
from bench.comparison import paired, print_comparisons, ttft_percentile
from bench.peer_runs import Conversation, load_average
from bench.results import BenchResult
from bench.replay import ReplayTurn, replay
from bench.served import Launch, PeakRss, peer_defaults_launch, running
from bench.trace_format import load_trace
from bench.workload_text import shared_system_prompt, tool_result

SMALL_ALIAS = "small"


@dataclass(frozen=True, slots=True)
class Sizes:
    agents: int  # per model
    turns: int
    system_tokens: int
    user_tokens: int
    reply_tokens: int
    repeats: int


FULL = Sizes(agents=8, turns=3, system_tokens=600, user_tokens=100, reply_tokens=32, repeats=2)
QUICK = Sizes(agents=3, turns=2, system_tokens=200, user_tokens=40, reply_tokens=8, repeats=1)


@dataclass(frozen=True, slots=True)
class Served:
    """Where each model's agents send their turns, and how (semantic's session id and model field)."""

    small_url: str
    large_url: str
    sends_session_id: bool
    small_model: str | None  # the body's model field for the small model's agents


@dataclass(slots=True)
class Run:
    wall_s: float
    turns: dict[str, list[Turn]] = field(default_factory=dict)  # "small" / "large" -> every turn
    peak_bytes: int = 0

    @property
    def all_turns(self) -> list[Turn]:
        return [t for turns in self.turns.values() for t in turns]


class Script:
    """The prompts, built once per model with its own tokenizer and sent identically to both server sets."""

    def __init__(self, tokenizers: dict[str, Tokenizer], sizes: Sizes) -> None:
        self.sizes = sizes
        self.system = {name: shared_system_prompt(tok, sizes.system_tokens) for name, tok in tokenizers.items()}
        self.users = {name: [[tool_result(tok, a, t, sizes.user_tokens) for t in range(sizes.turns)]
                             for a in range(sizes.agents)] for name, tok in tokenizers.items()}

    async def agents_of(self, client: ChatClient, name: str) -> list[Turn]:
        async def agent(a: int) -> list[Turn]:
            conversation = Conversation(f"{name}-agent-{a}", [{"role": "system", "content": self.system[name]}])
            return [await conversation.take_turn(client, t, self.users[name][a][t], self.sizes.reply_tokens)
                    for t in range(self.sizes.turns)]

        per_agent = await asyncio.gather(*(agent(a) for a in range(self.sizes.agents)))
        return [t for turns in per_agent for t in turns]

    async def run(self, served: Served) -> Run:
        async with ChatClient(served.small_url, served.sends_session_id, model=served.small_model) as small, \
                ChatClient(served.large_url, served.sends_session_id) as large:
            # Both models warm before the clock starts (the first request to semantic's extra model loads it).
            for client in (small, large):
                await client.turn("warmup", 0, [{"role": "user", "content": "Say hi."}], 4)
            started = time.perf_counter()
            small_turns, large_turns = await asyncio.gather(self.agents_of(small, "small"),
                                                            self.agents_of(large, "large"))
            return Run(time.perf_counter() - started, {"small": small_turns, "large": large_turns})


def semantic_launch_two(large: Path, small: Path | None, state_dir: Path, options: str = "") -> Launch:
    """``semantic --serve --model LARGE [--extra-model small=SMALL[,OPTIONS]]`` at its default budgets."""
    extra = ("--extra-model", f"{SMALL_ALIAS}={small}{options}") if small is not None else ()
    argv = (sys.executable, "-m", "semantic_cli", "--serve", "--model", str(large), *extra,
            "--cache-dir", str(state_dir), "--no-persist-on-exit", "--log-level", "warning")
    return Launch("semantic", argv, "/health/ready", sends_session_id=True, state_dir=state_dir)


@contextmanager
def semantic_set(large: Path, small: Path, work: Path) -> Iterator[tuple[Served, list[PeakRss]]]:
    with running(semantic_launch_two(large, small, work / "semantic-state"), work) as server:
        peak = PeakRss(server.process.pid)
        try:
            yield Served(server.url, server.url, True, SMALL_ALIAS), [peak]
        finally:
            peak.close()


@contextmanager
def peer_set(large: Path, small: Path, work: Path) -> Iterator[tuple[Served, list[PeakRss]]]:
    with ExitStack() as stack:
        servers = [stack.enter_context(running(peer_defaults_launch(folder), work)) for folder in (small, large)]
        peaks = [PeakRss(s.process.pid) for s in servers]
        try:
            yield Served(servers[0].url, servers[1].url, False, None), peaks
        finally:
            for peak in peaks:
                peak.close()


def run_once(name: str, script: Script, large: Path, small: Path, work: Path) -> Run:
    server_set = semantic_set if name == "semantic" else peer_set
    with server_set(large, small, work) as (served, peaks):
        run = asyncio.run(script.run(served))
    run.peak_bytes = sum(peak.bytes for peak in peaks)  # the samplers stopped with their servers
    print(f"#   {name}: wall {run.wall_s:.1f} s, TTFT p50 {ttft_percentile(run.all_turns, 50):.2f} s, "
          f"p95 {ttft_percentile(run.all_turns, 95):.2f} s, peak memory {run.peak_bytes / 2**20:.0f} MiB", flush=True)
    return run


TRACES = Path(__file__).parent / "traces"
TRACE_MAX_TOKENS = 64


def trace_workload(result: BenchResult, large: Path, small: Path, repeats: int) -> None:
    """The Claude Code trace with its side requests on a second model, against one model serving all of it."""
    requests = load_trace(TRACES / "claude_code_bare.jsonl") + load_trace(TRACES / "claude_code_haiku_side.jsonl")
    runs: dict[str, list[list[ReplayTurn]]] = {"two models": [], "one model": []}
    with tempfile.TemporaryDirectory(prefix="bench-two-models-trace-") as work:
        for repeat in range(repeats):
            for name in ("two models", "one model") if repeat % 2 == 0 else ("one model", "two models"):
                print(f"# trace run {repeat + 1}/{repeats}, {name} ({load_average()})", flush=True)
                launch = semantic_launch_two(large, small if name == "two models" else None,
                                             Path(work) / "state", ",side")
                with running(launch, Path(work)) as server:
                    if name == "two models":  # the side model loads on first use: warm it like the default
                        asyncio.run(_warm(server.url, SMALL_ALIAS))
                    turns = asyncio.run(replay(server.url, requests, "anthropic", TRACE_MAX_TOKENS, 0.0,
                                               verbose=False))
                if errors := [t for t in turns if not t.ok]:
                    raise RuntimeError(f"{name}: {len(errors)} requests failed: {errors[0].error}")
                runs[name].append(turns)
                main, side = _main_turns(turns), _side_turns(turns)
                print(f"#   {name}: main TTFT {', '.join(f'{t.ttft_s:.2f}' for t in main)} s; side latency "
                      f"{', '.join(f'{t.total_s:.2f}' for t in side)} s", flush=True)
    ours, theirs = runs["two models"], runs["one model"]
    workload = "Claude Code trace, side requests on a second model vs one model for all"
    for index in range(len(_main_turns(ours[0]))):
        paired(result, workload, f"main turn {index + 1} TTFT", "s",
               lambda r, i=index: _main_turns(r)[i].ttft_s, ours, theirs)
    paired(result, workload, "side requests: median latency", "s",
           lambda r: statistics.median(t.total_s for t in _side_turns(r)), ours, theirs)
    paired(result, workload, "side requests: slowest", "s", lambda r: max(t.total_s for t in _side_turns(r)),
           ours, theirs)
    result.notes.append(f"trace: ratios are one model / two models (above 1: the side model helped); max_tokens "
                        f"capped at {TRACE_MAX_TOKENS}; every session at once, back to back")


def _main_turns(turns: list[ReplayTurn]) -> list[ReplayTurn]:
    return [t for t in turns if t.session == "s1"]  # the bare trace's session comes first in the file


def _side_turns(turns: list[ReplayTurn]) -> list[ReplayTurn]:
    return [t for t in turns if t.session != "s1"]


async def _warm(url: str, model: str) -> None:
    async with ChatClient(url, sends_session_id=True, model=model) as client:
        await client.turn("warmup-side", 0, [{"role": "user", "content": "Say hi."}], 4)


WORKLOADS = ("agents", "trace")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser._option_string_actions["--model"].help = "the small model, served as extra model 'small' (default: smollm2-135m)"
    parser._option_string_actions["--pool-mb"].help = "unused: semantic runs at its default budgets here"
    parser.add_argument("--large", default="gemma3-270m", help="the default model (default: gemma3-270m)")
    parser.add_argument("--repeats", type=int, help="runs per server set (default: 1 quick, 2 full)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, any of {', '.join(WORKLOADS)} (default: all)")
    args = parser.parse_args()
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := [w for w in chosen if w not in WORKLOADS]:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    sizes = QUICK if args.quick else FULL
    if args.repeats:
        sizes = replace(sizes, repeats=args.repeats)
    small, large = model_folder(args.model, args.cache_dir), model_folder(args.large, args.cache_dir)
    tokenizers = {name: Tokenizer.from_file(str(folder / "tokenizer.json"))
                  for name, folder in (("small", small), ("large", large))}
    print(f"# small model {small}\n# large (default) model {large}\n# {'quick' if args.quick else 'full'}: {sizes}")
    result = BenchResult("bench_two_models", "Two models, many agents: semantic against one mlx_lm.server per model",
                         args={"model": args.model, "large": args.large, "quick": args.quick, "sizes": str(sizes),
                               "workloads": chosen})
    started = time.perf_counter()
    if "trace" in chosen:
        trace_workload(result, large, small, sizes.repeats)
        result.duration_s = time.perf_counter() - started
        result.write(args.json)  # kept if the next workload fails
    if "agents" in chosen:
        agents_workload(result, Script(tokenizers, sizes), large, small, sizes)
    print_comparisons(result.comparisons)
    result.duration_s = time.perf_counter() - started
    result.write(args.json)
    print(f"# finished in {result.duration_s:.0f} s")


def agents_workload(result: BenchResult, script: Script, large: Path, small: Path, sizes: Sizes) -> None:
    runs: dict[str, list[Run]] = {"semantic": [], "peers": []}
    with tempfile.TemporaryDirectory(prefix="bench-two-models-") as work:
        for repeat in range(sizes.repeats):
            for name in ("semantic", "peers") if repeat % 2 == 0 else ("peers", "semantic"):
                print(f"# run {repeat + 1}/{sizes.repeats}, {name} ({load_average()})", flush=True)
                runs[name].append(run_once(name, script, large, small, Path(work)))
    ours, theirs = runs["semantic"], runs["peers"]
    workload = f"{sizes.agents} agents on each of 2 models x {sizes.turns} turns"
    paired(result, workload, "total wall time", "s", lambda r: r.wall_s, ours, theirs, target=1.5)
    for q in (50, 95):
        paired(result, workload, f"TTFT p{q}, every turn", "s", lambda r, q=q: ttft_percentile(r.all_turns, q),
               ours, theirs)
    for model in ("small", "large"):
        paired(result, workload, f"TTFT p50, {model} model's turns", "s",
               lambda r, m=model: ttft_percentile(r.turns[m], 50), ours, theirs)
    paired(result, workload, "peak memory (semantic's process; the sum of both peers' peaks)", "MiB",
           lambda r: r.peak_bytes / 2**20, ours, theirs, target=1.0)
    result.notes.append(f"agents: small model {small.name} (model field '{SMALL_ALIAS}'), large {large.name}; "
                        "greedy; peers: two `mlx_lm.server --model FOLDER` at their defaults, one per model, together")


if __name__ == "__main__":
    main()
