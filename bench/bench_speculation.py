"""Speculative decoding (prompt lookup inside the batch): semantic with it, without it, and mlx_lm.server.

Three servers on the same model folder, one at a time, in alternating order
each repeat, over up to three workloads (``--workloads``):

- copy: each agent gets a ~1K-token source file of this repository and is
  asked to return it whole with one rename (what an agent's ``Write`` of an
  edited file is: its output copies its context);
- free: each agent writes a story (nothing to copy);
- claude-code-write: recorded Claude Code turns (``write_turns.py``): the
  CLI's whole request (system prompt, tools, ~20K tokens) after it read a
  source file for a rename, the turn whose answer is the file written back.
  Sent as the CLI sends it (Anthropic Messages) to semantic, translated to
  OpenAI chat for the peer. It needs a model with that much context (Gemma 3
  270M: ``--model gemma3-270m``; SmolLM2's is 8K). The sessions run one
  after another at 1 agent (a burst of them would time ~20K-token prefills,
  not decoding), ``--write-turns`` of them; decode throughput is their tokens
  over the sum of their decode times. What the model writes is its own: a
  small model does not always follow the ask (the table's tokens column says
  how much it wrote).

copy and free run at 1 agent and at ``--agents`` agents at once, greedy,
streamed through the OpenAI chat API. The measure is decode throughput:
completion tokens over the time from the first token to the last answer
(prefill left out: the same prompt on both semantic runs, and this is not a
prefill benchmark). semantic's usage extension (for the recorded turns: its
``/v1/stats`` row of the turn's fresh agent) gives each turn's drafts,
acceptance and tokens per speculative step; greedy outputs with and without
speculation are compared text for text (they must be identical).

The peer runs at its defaults, as a user runs it (``mlx_lm.server --model
FOLDER``): it has no prompt lookup, and with a draft model it serves one
request at a time.

``--draft-model REF``: the drafts come from that model instead, on both
sides as a user with a draft model runs them (``semantic --draft-model``,
``mlx_lm.server --draft-model``); the rest is the same.

Run: ``LD_PRELOAD=... python -m bench.bench_speculation [--model M] [--draft-model D] [--agents 8] [--repeats 2]
[--workloads copy,free,claude-code-write] [--write-turns 4] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from bench.chat_stream import ChatClient, Turn
from bench.common import base_parser, print_table
from bench.peer_runs import load_average
from bench.results import BenchResult, compare
from bench.served import Batching, Launch, semantic_launch, serving
from bench.workload_text import story_request
from bench.write_turns import agent_row, send_write_turn, write_turns

from bench.bench_vs_mlx_lm_server import model_folder

ROOT = Path(__file__).resolve().parents[1]
# Source files the copy workload hands out, one per agent (cut to FILE_TOKENS tokens at a line end).
SOURCES = [
    "engine/runtime/runner/drafting.py", "engine/runtime/runner/sampling.py", "engine/domain/block_pool.py",
    "engine/runtime/runner/kv/window_kv.py", "engine/store/atomic_text.py", "engine/api/metrics.py",
    "engine/runtime/runner/kv/full_kv.py", "engine/domain/forensics.py",
]
FILE_TOKENS = 1000


@dataclass(frozen=True, slots=True)
class Sizes:
    copy_tokens: int = 640  # a ~1K-token file's rewrite is longer; the cap keeps a run short on a CPU
    free_tokens: int = 256
    repeats: int = 2
    write_turns: int = 4  # recorded sessions, one after another: each prefills ~20K tokens (a minute on a CPU)


QUICK = Sizes(copy_tokens=160, free_tokens=96, repeats=1, write_turns=1)
WORKLOADS = ("copy", "free", "claude-code-write")
RECORDED = "claude-code-write"


def copy_request(tokenizer: Tokenizer, path: str) -> list[dict[str, str]]:
    """A file cut to about FILE_TOKENS tokens, and the request to return it with one rename."""
    text = (ROOT / path).read_text()
    lines, kept = text.splitlines(keepends=True), []
    for line in lines:
        if len(tokenizer.encode("".join(kept) + line).ids) > FILE_TOKENS:
            break
        kept.append(line)
    source = "".join(kept)
    names = re.findall(r"^(?:def|class) (\w+)", source, flags=re.M) or ["main"]
    old = names[0]
    return [{"role": "user", "content": (
        f"Here is the file {path}:\n\n```python\n{source}```\n\n"
        f"Rewrite the whole file with one change: rename `{old}` to `{old}_renamed` everywhere. "
        "Reply with the complete file in one code block and nothing else.")}]


def decode_tok_s(turns: list[Turn], one_after_another: bool = False) -> float:
    """Completion tokens over the time from the burst's first token to its last answer; for turns sent one after
    another, over the sum of their own decode times (the prefills between them left out)."""
    if one_after_another:
        span = sum(t.done_at - t.first_token_at for t in turns)
    else:
        span = max(t.done_at for t in turns) - min(t.first_token_at for t in turns)
    return sum(t.completion_tokens for t in turns) / max(span, 1e-9)


def tally(turns: list[Turn]) -> dict[str, float]:
    """semantic's speculation figures over a burst (drafts kept over drafts, tokens per speculative step)."""
    parts = [t.cache.get("speculation") or {} for t in turns]
    drafted, accepted = sum(p.get("drafted", 0) for p in parts), sum(p.get("accepted", 0) for p in parts)
    steps, emitted = sum(p.get("steps", 0) for p in parts), sum(p.get("emitted", 0) for p in parts)
    return {"acceptance": accepted / drafted if drafted else 0.0, "tokens_per_step": emitted / steps if steps else 0.0,
            "drafted": drafted}


async def burst(client: ChatClient, label: str, requests: list[list[dict[str, str]]], max_tokens: int) -> list[Turn]:
    return list(await asyncio.gather(*(client.turn(f"{label}-{i}", 0, messages, max_tokens)
                                       for i, messages in enumerate(requests))))


def peer_defaults(folder: Path, draft: Path | None = None) -> Launch:
    """mlx_lm.server as a user starts it: the model (and the draft model, if any) and nothing else (its own
    batching and cache defaults)."""
    argv = (sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--log-level", "WARNING")
    if draft is None:
        return Launch("mlx_lm.server", argv, None, sends_session_id=False)
    return Launch("mlx_lm.server (draft model)", (*argv, "--draft-model", str(draft)), None, sends_session_id=False)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8, help="agents at once in the batched runs (default 8)")
    parser.add_argument("--repeats", type=int, help="runs per server (default: 1 quick, 2 full)")
    parser.add_argument("--draft-model", help="a model with the same tokenizer to draft with, on semantic and on "
                                              "the peer (default: none; semantic looks drafts up)")
    parser.add_argument("--workloads", default="copy,free",
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default copy,free; {RECORDED} needs a "
                             "model with ~22K tokens of context, such as Gemma 3 270M)")
    parser.add_argument("--write-turns", type=int,
                        help=f"{RECORDED}: recorded sessions to replay, one after another (default: 1 quick, 4 full; "
                             "the trace holds 8)")
    args = parser.parse_args()
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown or not chosen:
        parser.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(WORKLOADS)}")
    sizes = QUICK if args.quick else Sizes()
    if args.repeats:
        sizes = replace(sizes, repeats=args.repeats)
    if args.write_turns:
        sizes = replace(sizes, write_turns=args.write_turns)
    folder = model_folder(args.model, args.cache_dir)
    draft = model_folder(args.draft_model, args.cache_dir) if args.draft_model else None
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    workloads = {
        "copy": ([copy_request(tokenizer, p) for p in SOURCES], sizes.copy_tokens),
        "free": ([story_request(len(SOURCES), i) for i in range(len(SOURCES))], sizes.free_tokens),
        RECORDED: (write_turns()[:sizes.write_turns] if RECORDED in chosen else [], sizes.copy_tokens),
    }
    workloads = {name: workloads[name] for name in chosen}
    if RECORDED in workloads:
        _check_context(folder, tokenizer, workloads[RECORDED][0], sizes.copy_tokens)
    levels = sorted({1, args.agents})
    print(f"# model folder {folder}\n# draft model {draft or 'none (lookup)'}\n"
          f"# {'quick' if args.quick else 'full'} sizes: {sizes}; agents {levels}")
    result = BenchResult("bench_speculation", "speculative decoding: semantic with and without it, and mlx_lm.server",
                         args={"model": args.model, "draft_model": args.draft_model, "quick": args.quick,
                               "agents": levels, "sizes": str(sizes)})
    started = time.perf_counter()
    # runs[server][workload][agents] -> one list of turns per repeat
    runs: dict[str, dict[str, dict[int, list[list[Turn]]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-speculation-") as work:
        work_dir = Path(work)
        on = semantic_launch(folder, work_dir / "state-on", args.pool_mb, Batching())
        if draft is not None:
            on = replace(on, name="semantic (draft model)", argv=(*on.argv, "--draft-model", str(draft)))
        off = replace(semantic_launch(folder, work_dir / "state-off", args.pool_mb, Batching()),
                      name="semantic (speculation off)")
        off = replace(off, argv=(*off.argv, "--speculate", "off"))
        launches = [on, off, peer_defaults(folder, draft)]
        for repeat in range(sizes.repeats):
            order = launches if repeat % 2 == 0 else launches[::-1]
            for launch in order:
                print(f"# run {repeat + 1}/{sizes.repeats}, {launch.name} ({load_average()})", flush=True)
                t0 = time.perf_counter()
                with serving(launch, work_dir) as url:
                    mine = asyncio.run(_all(url, launch, workloads, levels, repeat))
                for workload, by_level in mine.items():
                    for n, turns in by_level.items():
                        runs.setdefault(launch.name, {}).setdefault(workload, {}).setdefault(n, []).append(turns)
                print(f"#   done in {time.perf_counter() - t0:.0f} s", flush=True)
    _record(result, runs, on.name, off.name, launches[2].name, levels, workloads)
    result.duration_s = time.perf_counter() - started
    result.write(args.json)
    print(f"# finished in {result.duration_s:.0f} s")


def levels_of(workload: str, levels: list[int]) -> list[int]:
    """The recorded turns run at 1 agent only (see the module's docstring)."""
    return [1] if workload == RECORDED else levels


def _check_context(folder: Path, tokenizer: Tokenizer, requests, max_tokens: int) -> None:
    """Refuse, before any server starts, recorded turns longer than the model's context."""
    config = json.loads((folder / "config.json").read_text())
    context = (config.get("text_config") or config).get("max_position_embeddings")
    # The system prompt and tools alone are most of a turn: a lower bound on its length without the template.
    longest = max(len(tokenizer.encode(json.dumps(r.body.get("system")) + json.dumps(r.body.get("tools"))).ids)
                  for r in requests)
    if context and longest + max_tokens > context:
        raise SystemExit(f"--workloads {RECORDED}: its turns hold over {longest} tokens and the model's context is "
                         f"{context}; choose a model with a longer one (Gemma 3 270M: 32K)")


async def _all(url: str, launch: Launch, workloads, levels: list[int], repeat: int) -> dict[str, dict[int, list[Turn]]]:
    out: dict[str, dict[int, list[Turn]]] = {}
    async with ChatClient(url, launch.sends_session_id) as client:
        for workload, (requests, max_tokens) in workloads.items():
            if workload == RECORDED:
                out[workload] = {1: await _recorded(url, launch, requests, max_tokens, repeat)}
                continue
            for n in levels:
                # A fresh agent name per repeat and level: no run reuses another's cache.
                out.setdefault(workload, {})[n] = await burst(client, f"{workload}-{n}-r{repeat}", requests[:n], max_tokens)
    return out


async def _recorded(url: str, launch: Launch, requests, max_tokens: int, repeat: int) -> list[Turn]:
    """The recorded Claude Code turns one after another, each as a fresh agent; semantic's speculation figures
    read from its stats after each."""
    protocol = "anthropic" if launch.sends_session_id else "openai"
    turns = []
    async with httpx.AsyncClient(base_url=url, timeout=3600.0) as http:
        for i, request in enumerate(requests):
            agent = f"write-{i}-r{repeat}-{protocol}"
            turn = await send_write_turn(http, request, protocol, agent, max_tokens)
            if launch.sends_session_id:
                # A tool call streams whole once it closes, so its first delta comes with its end: decoding starts
                # at the engine's first token (its TTFT counts from the engine taking the turn, after the request
                # was read and rendered, so the decode time taken here is if anything too long).
                row = await agent_row(http, agent)
                turn = replace(turn, cache={"speculation": row.get("speculation") or {}},
                               first_token_at=turn.sent_at + row["last_ttft_s"])
            print(f"#   {RECORDED} {i}: prompt {turn.prompt_tokens} tokens, wrote {turn.completion_tokens}, "
                  f"prefill {turn.ttft_s:.0f} s, decode {turn.done_at - turn.first_token_at:.1f} s: "
                  f"{_excerpt(turn.text)}", flush=True)
            turns.append(turn)
    return turns


def _record(result: BenchResult, runs, on: str, off: str, peer: str, levels: list[int], workloads) -> None:
    rows = []
    targets = {("copy", 1): 2.0, ("copy", max(levels)): 1.4, ("free", 1): 0.95, ("free", max(levels)): 0.95,
               (RECORDED, 1): 2.0}
    for workload in workloads:
        sequential = workload == RECORDED
        for n in levels_of(workload, levels):
            with_it = [decode_tok_s(turns, sequential) for turns in runs[on][workload][n]]
            without = [decode_tok_s(turns, sequential) for turns in runs[off][workload][n]]
            peer_runs = [decode_tok_s(turns, sequential) for turns in runs[peer][workload][n]]
            name = f"{workload}, {n} agent{'s' if n > 1 else ''}: decode tok/s"
            result.comparisons.append(compare(f"{workload} vs speculation off", name, "tok/s", with_it, without,
                                              better="higher", target=targets.get((workload, n))))
            result.comparisons.append(compare(f"{workload} vs mlx_lm.server", name, "tok/s", with_it, peer_runs,
                                              better="higher", target=targets.get((workload, n))))
            figures = [tally(turns) for turns in runs[on][workload][n]]
            acceptance = statistics.median(f["acceptance"] for f in figures)
            per_step = statistics.median(f["tokens_per_step"] for f in figures)
            result.metric(f"{workload}, {n} agents", "draft acceptance", acceptance, "ratio", better="neither")
            result.metric(f"{workload}, {n} agents", "tokens per speculative step", per_step, "tokens", better="neither")
            first_on, first_off = runs[on][workload][n][0], runs[off][workload][n][0]
            same = sum(a.text == b.text for a, b in zip(first_on, first_off))
            result.notes.append(f"{workload}, {n} agents: greedy text identical with and without speculation for "
                                f"{same}/{len(first_on)} turns (first repeat)")
            written = [t.completion_tokens for t in first_on]
            if sequential:
                result.notes.append(f"{workload}: tokens each recorded turn's answer ran to with speculation (first "
                                    f"repeat): {written}; on mlx_lm.server: "
                                    f"{[t.completion_tokens for t in runs[peer][workload][n][0]]}")
            rows.append([workload, n, _spread(with_it), _spread(without), _spread(peer_runs),
                         f"{statistics.median(a / b for a, b in zip(with_it, without)):.2f}x",
                         f"{statistics.median(a / b for a, b in zip(with_it, peer_runs)):.2f}x",
                         f"{acceptance:.2f}", f"{per_step:.2f}", sum(written), f"{same}/{len(first_on)}"])
    print_table(["workload", "agents", "speculation tok/s", "off tok/s", "mlx_lm.server tok/s", "vs off", "vs peer",
                 "acceptance", "tokens/step", "tokens", "identical"], rows)
    for note in result.notes:
        print(f"# {note}")


def _excerpt(text: str, limit: int = 160) -> str:
    """What a recorded turn's answer was, on one line (the model's own: it may not follow the ask)."""
    flat = json.dumps(text)[1:-1]
    return flat if len(flat) <= limit else f"{flat[:limit]}... ({len(text)} characters)"


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


if __name__ == "__main__":
    main()
