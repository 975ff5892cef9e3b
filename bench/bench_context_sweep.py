"""Warm turns as the context grows: semantic vs mlx_lm.server, one agent, turn by turn.

One agent's conversation grows to each context level in turn (a long user
message brings it there), and at every level it takes ``--turns`` warm
turns of each shape: a turn adding ~64 new tokens (a tool result, a short
reply) and one adding ~200. Every reply is up to 32 tokens, greedy.

Per turn: time to first token on both servers (the same streaming client,
same model folder, same chat template, alternating which server goes first
per repeat); on semantic also the hand-off between the pool and the batch
(admission to the first prefill chunk, last token to the cache settled) and
the bytes of KV copied, from its ``usage.semantic`` extension.

Gemma 3 270M has no chat template: mlx_lm.server gets one (``--chat-template``)
that renders exactly what semantic renders for template-less models
(``System: ...`` / ``User: ...`` paragraphs, then ``Assistant:``); the first
turn's prompt token counts are compared to prove it.

Targets (issue 11): for ~64-token turns at least 1.1x at 4K-8K on SmolLM2
and 1.2x at 16K-32K on Gemma 3; ~200-token turns never behind (1.0x); the
hand-off within 2x from the smallest to the largest context.

Run: ``LD_PRELOAD=... python -m bench.bench_context_sweep [--model gemma3-270m] [--quick] [--json PATH]``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from bench.chat_stream import ChatClient, Turn
from bench.common import base_parser
from bench.comparison import paired, print_comparisons
from bench.peer_runs import Conversation, on_both, served_once
from bench.results import BenchResult, Series
from bench.served import Batching, Launch, peer_defaults_launch, peer_launch, semantic_launch
from bench.workload_text import growing_document, tool_result

from bench.bench_vs_mlx_lm_server import model_folder

REPLY_TOKENS = 32
SHAPES = {"+64": 64, "+200": 200}
# Context levels per model family; every level is reached by one long message, then measured. The
# last leaves room for its warm turns (about 1,100 tokens) inside the context (8,192 and 32,768).
LEVELS = {"smollm2": (1024, 2048, 4096, 7000), "gemma3": (4096, 16384, 30000)}
QUICK_LEVELS = {"smollm2": (1024, 2048), "gemma3": (2048, 4096)}
# What semantic renders for a model without a chat template (engine/formats/rendering.py, PromptRenderer._plain).
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n"
                  "{% endfor %}Assistant:")
# Targets per shape: (minimum context the target applies from, TTFT advantage).
TARGETS = {"smollm2": {"+64": (4096, 1.1), "+200": (0, 1.0)}, "gemma3": {"+64": (16384, 1.2), "+200": (0, 1.0)}}


@dataclass(frozen=True, slots=True)
class Step:
    kind: str  # "grow" or a shape name
    level: int
    tokens: int  # size of the user message


@dataclass(slots=True)
class Run:
    turns: list[tuple[Step, Turn]] = field(default_factory=list)

    def of(self, level: int, kind: str) -> list[Turn]:
        return [t for s, t in self.turns if s.level == level and s.kind == kind]


def family(folder: Path) -> str:
    return "gemma3" if "gemma" in folder.name.lower() else "smollm2"


def plan(levels: tuple[int, ...], turns: int) -> list[Step]:
    steps = []
    for level in levels:
        steps.append(Step("grow", level, 0))
        steps += [Step(kind, level, n) for kind, n in SHAPES.items() for _ in range(turns)]
    return steps


async def converse(client: ChatClient, tokenizer: Tokenizer, steps: list[Step]) -> Run:
    conversation, run, context = Conversation("sweep", []), Run(), 0
    for index, step in enumerate(steps):
        if step.kind == "grow":
            size = max(64, step.level - context - REPLY_TOKENS)
            message = growing_document(tokenizer, index, size)
        else:
            message = tool_result(tokenizer, 0, index, step.tokens)
        turn = await conversation.take_turn(client, index, message, REPLY_TOKENS)
        run.turns.append((step, turn))
        context = turn.prompt_tokens + turn.completion_tokens
        print(f"#   turn {index:2d} {step.kind:>5} ctx {turn.prompt_tokens:6d}  TTFT {turn.ttft_s:7.3f} s"
              + (f"  handoff {turn.cache.get('handoff_in_ms', 0):7.2f}+{turn.cache.get('handoff_out_ms', 0):6.2f} ms"
                 f"  copied {turn.cache.get('copied_bytes', 0) / 2**20:7.2f} MiB  reused {turn.cached_tokens}"
                 if turn.cache else ""), flush=True)
    return run


def compare_runs(result: BenchResult, model: str, levels: tuple[int, ...], ours: list[Run], theirs: list[Run]) -> None:
    targets = TARGETS[model]
    for level in levels:
        for kind in SHAPES:
            start, target = targets[kind]
            paired(result, "context sweep", f"{kind} turns at ~{level // 1000}K: TTFT median", "s",
                   lambda r, lv=level, k=kind: statistics.median(t.ttft_s for t in r.of(lv, k)),
                   ours, theirs, target=target if level >= start else None)


def handoff_metrics(result: BenchResult, levels: tuple[int, ...], ours: list[Run]) -> None:
    """semantic's hand-off and copies per level (median over repeats and warm turns)."""
    per_level = {}
    for level in levels:
        warm = [t for run in ours for kind in SHAPES for t in run.of(level, kind)]
        handoff = statistics.median(t.cache["handoff_in_ms"] + t.cache["handoff_out_ms"] for t in warm)
        copied = statistics.median(t.cache["copied_bytes"] for t in warm)
        per_level[level] = handoff
        result.metric("hand-off (semantic)", f"admission + settle at ~{level // 1000}K, median", handoff, "ms",
                      better="lower")
        result.metric("hand-off (semantic)", f"KV bytes copied per warm turn at ~{level // 1000}K, median",
                      copied / 2**20, "MiB", better="lower")
    growth = per_level[levels[-1]] / max(per_level[levels[0]], 1e-6)
    result.metric("hand-off (semantic)", f"growth from ~{levels[0] // 1000}K to ~{levels[-1] // 1000}K", growth, "x",
                  better="lower", target=2.0)


def series(result: BenchResult, levels: tuple[int, ...], ours: list[Run], theirs: list[Run]) -> None:
    for kind in SHAPES:
        x = [lv // 1000 for lv in levels]
        result.series.append(Series(
            f"context sweep: {kind} warm-turn TTFT", "context (K tokens)", "TTFT s (median)", x,
            {"semantic": [_median(ours, lv, kind) for lv in levels],
             "mlx_lm.server": [_median(theirs, lv, kind) for lv in levels]},
        ))
    result.series.append(Series(
        "context sweep: semantic hand-off per warm turn", "context (K tokens)", "ms (median)",
        [lv // 1000 for lv in levels],
        {"admission": [statistics.median(t.cache["handoff_in_ms"] for r in ours for k in SHAPES for t in r.of(lv, k))
                       for lv in levels],
         "settle": [statistics.median(t.cache["handoff_out_ms"] for r in ours for k in SHAPES for t in r.of(lv, k))
                    for lv in levels]},
    ))


def _median(runs: list[Run], level: int, kind: str) -> float:
    return statistics.median(t.ttft_s for r in runs for t in r.of(level, kind))


def check_same_prompts(ours: list[Run], theirs: list[Run]) -> str:
    """Both servers must have seen the same tokens, or the comparison compares templates."""
    a = [t.prompt_tokens for _, t in ours[0].turns]
    b = [t.prompt_tokens for _, t in theirs[0].turns]
    if a[0] != b[0]:
        raise SystemExit(f"the servers rendered different prompts: {a[0]} vs {b[0]} tokens on the first turn")
    same = sum(x == y for x, y in zip(a, b))
    return f"prompt token counts equal on both servers for {same}/{len(a)} turns (first repeat)"


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per server (default 2; 1 with --quick)")
    parser.add_argument("--turns", type=int, help="warm turns per shape and level (default 3; 2 with --quick)")
    parser.add_argument("--peer", choices=("defaults", "tuned"), default="defaults",
                        help="defaults: `mlx_lm.server --model FOLDER` as users run it (the default); tuned: its "
                             "batching set equal to semantic's")
    args = parser.parse_args()
    folder = model_folder(args.model, args.cache_dir)
    model = family(folder)
    levels = QUICK_LEVELS[model] if args.quick else LEVELS[model]
    repeats = 1 if args.quick and args.repeats == 2 else args.repeats
    turns = args.turns or (2 if args.quick else 3)
    steps = plan(levels, turns)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    result = BenchResult("bench_context_sweep", "Warm turns as the context grows (vs mlx_lm.server)",
                         args={"model": args.model, "quick": args.quick, "levels": list(levels), "turns": turns,
                               "repeats": repeats, "reply_tokens": REPLY_TOKENS, "peer": args.peer})
    print(f"# model folder {folder}; levels {levels}; {turns} turns per shape; {repeats} repeats; "
          f"peer: mlx_lm.server {'at its defaults' if args.peer == 'defaults' else 'tuned (batching as semantic)'}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as work:
        batching = Batching()
        peer = peer_defaults_launch(folder) if args.peer == "defaults" else peer_launch(folder, batching, cache_entries=10)
        if model == "gemma3":
            peer = Launch(peer.name, peer.argv + ("--chat-template", PLAIN_TEMPLATE), peer.ready_path,
                          peer.sends_session_id)
        launches = (semantic_launch(folder, Path(work) / "semantic", args.pool_mb, batching), peer)

        async def work_fn(client: ChatClient) -> Run:
            return await converse(client, tokenizer, steps)

        ours, theirs = on_both(launches, repeats, lambda launch: served_once(launch, Path(work), work_fn))
    note = check_same_prompts(ours, theirs)
    print(note)
    result.notes.append(note)
    compare_runs(result, model, levels, ours, theirs)
    handoff_metrics(result, levels, ours)
    series(result, levels, ours, theirs)
    print_comparisons(result.comparisons)
    for m in result.metrics:
        print(f"{m.group}: {m.name} = {m.value:.3f} {m.unit}" + (f" (target {m.target})" if m.target else ""))
    result.duration_s = time.perf_counter() - started
    result.write(args.json)


if __name__ == "__main__":
    main()
