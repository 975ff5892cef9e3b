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

Gemma 3 270M ships without a chat template: semantic renders its plain
``User:``/``Assistant:`` format, mlx_lm.server its own fallback (``USER:``),
so the two see slightly different prompt tokens for the same messages.

Run: ``LD_PRELOAD=... python -m bench.bench_two_models [--quick] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer

from bench.bench_vs_mlx_lm_server import model_folder
from bench.chat_stream import ChatClient, Turn
from bench.common import base_parser
from bench.comparison import paired, print_comparisons, ttft_percentile
from bench.peer_runs import Conversation, load_average
from bench.results import BenchResult
from bench.served import Launch, PeakRss, peer_defaults_launch, running
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


def semantic_launch_two(large: Path, small: Path, state_dir: Path) -> Launch:
    argv = (sys.executable, "-m", "semantic_cli", "--serve", "--model", str(large),
            "--extra-model", f"{SMALL_ALIAS}={small}", "--cache-dir", str(state_dir), "--no-persist-on-exit",
            "--log-level", "warning")
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
        for peak in peaks:
            peak.close()
        run.peak_bytes = sum(peak.bytes for peak in peaks)
    print(f"#   {name}: wall {run.wall_s:.1f} s, TTFT p50 {ttft_percentile(run.all_turns, 50):.2f} s, "
          f"p95 {ttft_percentile(run.all_turns, 95):.2f} s, peak memory {run.peak_bytes / 2**20:.0f} MiB", flush=True)
    return run


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(model="smollm2-135m")
    parser.add_argument("--large", default="gemma3-270m", help="the default model (default: gemma3-270m)")
    parser.add_argument("--repeats", type=int, help="runs per server set (default: 1 quick, 2 full)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.repeats:
        sizes = Sizes(**{**{f: getattr(sizes, f) for f in Sizes.__dataclass_fields__}, "repeats": args.repeats})
    small, large = model_folder(args.model, args.cache_dir), model_folder(args.large, args.cache_dir)
    tokenizers = {name: Tokenizer.from_file(str(folder / "tokenizer.json"))
                  for name, folder in (("small", small), ("large", large))}
    print(f"# small model {small}\n# large (default) model {large}\n# {'quick' if args.quick else 'full'}: {sizes}")
    result = BenchResult("bench_two_models", "Two models, many agents: semantic against one mlx_lm.server per model",
                         args={"model": args.model, "large": args.large, "quick": args.quick, "sizes": str(sizes)})
    script = Script(tokenizers, sizes)
    runs: dict[str, list[Run]] = {"semantic": [], "peers": []}
    started = time.perf_counter()
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
    print_comparisons(result.comparisons)
    result.notes.append(f"small model {args.model} (model field '{SMALL_ALIAS}'), large {args.large}; greedy; "
                        f"peers: two `mlx_lm.server --model FOLDER` at their defaults, one per model, run together")
    result.duration_s = time.perf_counter() - started
    result.write(args.json)
    print(f"# finished in {result.duration_s:.0f} s")


if __name__ == "__main__":
    main()
