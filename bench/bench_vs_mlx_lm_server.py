"""semantic vs mlx_lm.server: the same model folder, the same workloads, in the same run.

1. throughput   N agents (1, 4, 8, 16) at once, each generating 128 tokens from a
                distinct prompt: aggregate tok/s, p50/p95 time to first token.
2. multiturn    16 agents x 4 turns, all agents working at once (each sends its
                next turn when the last one is answered, so turns interleave
                across agents); every agent starts with the same ~1,000-token
                system prompt, then its own tool results and replies. The KV
                budget holds about 6 agents, on both servers.
3. restart      the multi-turn workload with a server restart (SIGTERM, start
                again) between turns 2 and 3.
4. longctx      one agent whose conversation grows to ~4K tokens over 8 turns.

Both servers run as subprocesses on a loopback port (bench/served.py), one at a
time, and are driven by the same streaming OpenAI chat-completions client;
semantic also gets its ``session_id`` extension, the peer reuses prefixes
through its own LRU prompt cache. Each workload runs ``--repeats`` times per
server, alternating which goes first; every metric is reported as min/median/
max per server and of the per-repeat ratio ("semantic advantage": above 1
means semantic did better). Targets (issue 7): throughput >= 1.0x, multiturn
>= 3x total wall time, restart >= 10x fewer prefilled tokens.

Run: ``make bench`` (all benchmarks and the report), or
``LD_PRELOAD=... python -m bench.bench_vs_mlx_lm_server [--quick] [--workloads multiturn,restart] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import Tokenizer

from bench.chat_stream import ChatClient, Turn
from bench.common import base_parser
from bench.comparison import (
    aggregate_tok_s,
    cached_percent,
    mean_ttft,
    paired,
    prefilled_tokens,
    print_comparisons,
    retries_note,
    ttft_percentile,
)
from bench.peer_runs import Conversation, Outcome, on_both, served_once, served_with_restart
from bench.results import BenchResult, Series
from bench.served import Batching, Launch, peer_defaults_launch, peer_launch, semantic_launch
from bench.workload_text import growing_document, shared_system_prompt, story_request, tool_result

from engine.domain.cache_spec import DTYPE_BYTES
from engine.models.loader import resolve_model
from engine.settings import default_cache_dir

BLOCK_TOKENS = 256  # semantic's default --block-tokens: its pool hands out KV memory in blocks of this many tokens
TEMPLATE_TOKENS = 12  # role markers the chat template adds around each message


@dataclass(frozen=True, slots=True)
class Sizes:
    streams: tuple[int, ...]  # throughput: agents at once
    stream_tokens: int
    agents: int  # multiturn / restart
    turns: int
    system_tokens: int
    user_tokens: int  # each turn's tool result
    reply_tokens: int
    fit_agents: int  # how many whole agents the KV budget holds
    restart_after: int  # restart: turns before the restart
    long_turns: int
    long_context: int  # longctx: tokens the conversation reaches
    long_reply: int
    repeats: int


FULL = Sizes(streams=(1, 4, 8, 16), stream_tokens=128, agents=16, turns=4, system_tokens=1000, user_tokens=100,
             reply_tokens=32, fit_agents=6, restart_after=2, long_turns=8, long_context=4096, long_reply=32,
             repeats=2)
QUICK = Sizes(streams=(1, 4), stream_tokens=16, agents=6, turns=3, system_tokens=300, user_tokens=40,
              reply_tokens=8, fit_agents=3, restart_after=2, long_turns=3, long_context=1024, long_reply=8,
              repeats=1)


@dataclass(frozen=True, slots=True)
class Bench:
    folder: Path
    tokenizer: Tokenizer
    batching: Batching
    pool_mb: float
    work_dir: Path
    sizes: Sizes
    result: BenchResult
    peer_at_defaults: bool = False  # --peer defaults: mlx_lm.server as users start it, no flags
    raw_prompts: bool = False  # --api completions: turns as raw prompts to /v1/completions (base models)

    def peer(self, cache_entries: int, cache_bytes: int | None = None) -> Launch:
        """The peer: tuned (its batching set equal to semantic's, a cache sized like semantic's pool) or at its
        defaults."""
        if self.peer_at_defaults:
            launch = peer_defaults_launch(self.folder)
        else:
            launch = peer_launch(self.folder, self.batching, cache_entries=cache_entries, cache_bytes=cache_bytes)
        return replace(launch, raw_prompts=self.raw_prompts)

    def semantic(self, workload: str, pool_mb: float | None = None, persist: bool = False) -> Launch:
        """semantic with its own disk tier for this workload, emptied before each fresh start."""
        state = self.work_dir / f"semantic-{workload}"
        launch = semantic_launch(self.folder, state, pool_mb or self.pool_mb, self.batching, persist=persist)
        return replace(launch, raw_prompts=self.raw_prompts)

    def record(self, comparisons_from: int = 0) -> None:
        print_comparisons(self.result.comparisons[comparisons_from:])


# -- 1. throughput ------------------------------------------------------------------------------
def throughput(bench: Bench) -> None:
    s = bench.sizes
    print(f"\n## throughput: 1-{max(s.streams)} agents at once, {s.stream_tokens} tokens each, distinct prompts")
    launches = (bench.semantic("throughput"), bench.peer(cache_entries=10))

    async def work(client: ChatClient) -> list[list[Turn]]:
        return [await _burst(client, n, s.stream_tokens) for n in s.streams]

    ours, theirs = on_both(launches, s.repeats, lambda launch: served_once(launch, bench.work_dir, work))
    first = len(bench.result.comparisons)
    for level, n in enumerate(s.streams):
        pick = _level(level)
        paired(bench.result, "throughput", f"{n} agents: aggregate tok/s", "tok/s", lambda r: aggregate_tok_s(pick(r)),
               ours, theirs, better="higher", target=1.0)
        paired(bench.result, "throughput", f"{n} agents: TTFT p50", "s", lambda r: ttft_percentile(pick(r), 50),
               ours, theirs)
        paired(bench.result, "throughput", f"{n} agents: TTFT p95", "s", lambda r: ttft_percentile(pick(r), 95),
               ours, theirs)
    bench.record(first)
    bench.result.series.append(Series(
        "throughput: aggregate tok/s", "agents at once", "tok/s (median)", list(s.streams),
        {"semantic": [_median_of(ours, lambda r, i=i: aggregate_tok_s(r[i])) for i in range(len(s.streams))],
         "mlx_lm.server": [_median_of(theirs, lambda r, i=i: aggregate_tok_s(r[i])) for i in range(len(s.streams))]},
    ))
    _note(bench, retries_note("throughput", [t for run in ours for t in _flat(run)],
                                          [t for run in theirs for t in _flat(run)]))
    _note(bench, greedy_match("throughput", _flat(ours[0]), _flat(theirs[0])))


def _level(level: int) -> Callable[[list[list[Turn]]], list[Turn]]:
    return lambda run: run[level]


async def _burst(client: ChatClient, n_streams: int, max_tokens: int) -> list[Turn]:
    return await asyncio.gather(*(client.turn(f"stream-{n_streams}-{i}", 0, story_request(n_streams, i), max_tokens)
                                  for i in range(n_streams)))


# -- 2 and 3. multi-turn agents, with and without a restart ---------------------------------------
def _agent_tokens(s: Sizes) -> int:
    return s.system_tokens + s.turns * (s.user_tokens + s.reply_tokens + 2 * TEMPLATE_TOKENS)


def _conversation_launches(bench: Bench, workload: str, persist: bool) -> tuple[Launch, Launch, int]:
    s = bench.sizes
    budget = s.fit_agents * kv_bytes(bench.folder, _agent_tokens(s))
    # The bytes bind the peer, not its entry count: each chat leaves a system, a user and an assistant entry.
    peer = bench.peer(cache_entries=4 * s.agents, cache_bytes=budget)
    return bench.semantic(workload, budget / 2**20, persist=persist), peer, budget


class AgentScript:
    """The prompts of the multi-turn workload, built once and sent identically to both servers."""

    def __init__(self, bench: Bench) -> None:
        s = bench.sizes
        self.system = shared_system_prompt(bench.tokenizer, s.system_tokens)
        self.users = [[tool_result(bench.tokenizer, a, t, s.user_tokens) for t in range(s.turns)]
                      for a in range(s.agents)]
        self.reply_tokens = s.reply_tokens

    def conversations(self) -> list[Conversation]:
        return [Conversation(f"agent-{a}", [{"role": "system", "content": self.system}]) for a in range(len(self.users))]

    async def turns(self, client: ChatClient, conversations: list[Conversation], turns: range) -> list[Turn]:
        """Every agent at once, each taking ``turns`` in order: an agent's next turn follows its last answer."""
        async def agent_loop(a: int, conversation: Conversation) -> list[Turn]:
            return [await conversation.take_turn(client, t, self.users[a][t], self.reply_tokens) for t in turns]

        per_agent = await asyncio.gather(*(agent_loop(a, c) for a, c in enumerate(conversations)))
        return [t for turns_of_agent in per_agent for t in turns_of_agent]


def multiturn(bench: Bench) -> None:
    s = bench.sizes
    ours_launch, peer, budget = _conversation_launches(bench, "multiturn", persist=False)
    print(f"\n## multiturn: {s.agents} agents x {s.turns} turns at once, shared {s.system_tokens}-token system prompt, "
          f"{s.user_tokens}-token tool results, {s.reply_tokens}-token replies, KV budget {budget / 2**20:.0f} MiB "
          f"(~{s.fit_agents} agents of ~{_agent_tokens(s)} tokens) on both")
    script = AgentScript(bench)

    async def work(client: ChatClient) -> Outcome:
        t0 = time.perf_counter()
        turns = await script.turns(client, script.conversations(), range(s.turns))
        return Outcome(turns, time.perf_counter() - t0)

    ours, theirs = on_both((ours_launch, peer), s.repeats,
                           lambda launch: served_once(launch, bench.work_dir, work))
    first = len(bench.result.comparisons)
    paired(bench.result, "multiturn", "total wall time", "s", lambda o: o.wall_s, ours, theirs, target=3.0)
    _conversation_metrics(bench, "multiturn", s.turns, ours, theirs)
    bench.record(first)
    _turn_series(bench, "multiturn", ours, theirs)
    _note(bench, retries_note("multiturn", _turns(ours), _turns(theirs)))
    _note(bench, greedy_match("multiturn", ours[0].turns, theirs[0].turns))


def restart(bench: Bench) -> None:
    s = bench.sizes
    ours_launch, peer, budget = _conversation_launches(bench, "restart", persist=True)
    print(f"\n## restart: the multiturn workload, server restarted between turns {s.restart_after} and "
          f"{s.restart_after + 1} (KV budget {budget / 2**20:.0f} MiB on both; semantic writes its hot agents "
          f"to disk on SIGTERM)")
    script = AgentScript(bench)

    def run(launch: Launch) -> Outcome:
        conversations = script.conversations()

        async def before(client: ChatClient) -> list[Turn]:
            return await script.turns(client, conversations, range(s.restart_after))

        async def after(client: ChatClient) -> list[Turn]:
            return await script.turns(client, conversations, range(s.restart_after, s.turns))

        return served_with_restart(launch, bench.work_dir, before, after)

    ours, theirs = on_both((ours_launch, peer), s.repeats, run)
    first = len(bench.result.comparisons)
    paired(bench.result, "restart", "prefilled tokens, all turns", "tok", lambda o: prefilled_tokens(o.turns),
           ours, theirs, target=10.0)
    paired(bench.result, "restart", f"prefilled tokens, turns {s.restart_after + 1}+ (after the restart)", "tok",
           lambda o: prefilled_tokens(o.from_turn(s.restart_after)), ours, theirs)
    paired(bench.result, "restart", f"TTFT mean, turn {s.restart_after + 1} (first after the restart)", "s",
           lambda o: mean_ttft(o.turns_at(s.restart_after)), ours, theirs)
    paired(bench.result, "restart", "total wall time (turns only)", "s", lambda o: o.wall_s, ours, theirs)
    paired(bench.result, "restart", "restart downtime (stop to first answer)", "s", lambda o: o.restart_s,
           ours, theirs)
    bench.record(first)
    _turn_series(bench, "restart", ours, theirs)
    _note(bench, retries_note("restart", _turns(ours), _turns(theirs)))


def _conversation_metrics(bench: Bench, workload: str, n_turns: int, ours: list[Outcome],
                          theirs: list[Outcome]) -> None:
    paired(bench.result, workload, "prefilled tokens", "tok", lambda o: prefilled_tokens(o.turns), ours, theirs)
    paired(bench.result, workload, "prompt tokens from cache", "%", lambda o: cached_percent(o.turns), ours, theirs,
           better="higher")
    for index in range(n_turns):
        paired(bench.result, workload, f"TTFT mean, turn {index + 1}", "s", lambda o, i=index: mean_ttft(o.turns_at(i)),
               ours, theirs)


def _turn_series(bench: Bench, workload: str, ours: list[Outcome], theirs: list[Outcome]) -> None:
    n_turns = max(t.index for t in ours[0].turns) + 1
    turns = list(range(1, n_turns + 1))
    bench.result.series.append(Series(
        f"{workload}: time to first token per turn", "turn", "mean TTFT s (median of repeats)", turns,
        {"semantic": [_median_of(ours, lambda o, i=i: mean_ttft(o.turns_at(i - 1))) for i in turns],
         "mlx_lm.server": [_median_of(theirs, lambda o, i=i: mean_ttft(o.turns_at(i - 1))) for i in turns]},
    ))
    bench.result.series.append(Series(
        f"{workload}: prefilled tokens per turn", "turn", "tokens computed (median of repeats)", turns,
        {"semantic": [_median_of(ours, lambda o, i=i: prefilled_tokens(o.turns_at(i - 1))) for i in turns],
         "mlx_lm.server": [_median_of(theirs, lambda o, i=i: prefilled_tokens(o.turns_at(i - 1))) for i in turns]},
        kind="bar",
    ))


# -- 4. long context ----------------------------------------------------------------------------
def longctx(bench: Bench) -> None:
    s = bench.sizes
    per_turn = s.long_context // s.long_turns - s.long_reply - 2 * TEMPLATE_TOKENS
    print(f"\n## longctx: one agent, {s.long_turns} turns of ~{per_turn} new tokens, growing to ~{s.long_context}")
    users = [growing_document(bench.tokenizer, t, per_turn) for t in range(s.long_turns)]
    launches = (bench.semantic("longctx"), bench.peer(cache_entries=10))

    async def work(client: ChatClient) -> Outcome:
        conversation = Conversation("reader", [])
        t0 = time.perf_counter()
        turns = [await conversation.take_turn(client, t, users[t], s.long_reply) for t in range(s.long_turns)]
        return Outcome(turns, time.perf_counter() - t0)

    ours, theirs = on_both(launches, s.repeats, lambda launch: served_once(launch, bench.work_dir, work))
    first = len(bench.result.comparisons)
    paired(bench.result, "longctx", "total wall time", "s", lambda o: o.wall_s, ours, theirs)
    _conversation_metrics(bench, "longctx", s.long_turns, ours, theirs)
    bench.record(first)
    contexts = [t.prompt_tokens for t in ours[0].turns]
    bench.result.series.append(Series(
        "longctx: time to first token as the context grows", "prompt tokens", "TTFT s (median of repeats)", contexts,
        {"semantic": [_median_of(ours, lambda o, i=i: o.turns[i].ttft_s) for i in range(s.long_turns)],
         "mlx_lm.server": [_median_of(theirs, lambda o, i=i: o.turns[i].ttft_s) for i in range(s.long_turns)]},
    ))
    _note(bench, greedy_match("longctx", ours[0].turns, theirs[0].turns))


# -- shared helpers -----------------------------------------------------------------------------
def kv_bytes(folder: Path, n_tokens: int) -> int:
    """KV bytes of one agent of ``n_tokens`` in whole blocks (uniform full-attention models such as SmolLM2)."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    dtype = DTYPE_BYTES[config.get("torch_dtype", "float32")]
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype
    return math.ceil(n_tokens / BLOCK_TOKENS) * BLOCK_TOKENS * per_token


def greedy_match(workload: str, ours: list[Turn], theirs: list[Turn]) -> str:
    """Same model, same template, greedy: any difference points at a template or tokenizer gap. (Compared without
    a leading blank: mlx_lm.server drops a raw completion's, semantic keeps it; a chat reply's both drop.)"""
    peer_text = {(t.agent, t.index): t.text.lstrip(" ") for t in theirs}
    same = [t for t in ours if peer_text.get((t.agent, t.index)) == t.text.lstrip(" ")]
    return f"{workload}: greedy outputs identical on both servers for {len(same)}/{len(ours)} turns (first repeat)"


def _median_of(runs, measure) -> float:
    return statistics.median(measure(r) for r in runs)


def _turns(runs: list[Outcome]) -> list[Turn]:
    return [t for run in runs for t in run.turns]


def _flat(bursts: list[list[Turn]]) -> list[Turn]:
    return [t for burst in bursts for t in burst]


def _note(bench: Bench, note: str | None) -> None:
    if note:
        print(note)
        bench.result.notes.append(note)


WORKLOADS: dict[str, Callable[[Bench], None]] = {
    "throughput": throughput, "multiturn": multiturn, "restart": restart, "longctx": longctx,
}


def model_folder(ref: str, cache_dir: Path | None = None) -> Path:
    """The local MLX folder of ``ref`` (a packaged alias is imported under ``cache_dir``, by default the
    server's own cache directory)."""
    resolved = resolve_model(ref, cache_dir if cache_dir is not None else default_cache_dir())
    if not resolved.is_local:
        raise SystemExit(f"{ref!r} is a hub id; pass a local MLX folder, .gguf file or packaged alias")
    return Path(resolved.location)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, any of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--repeats", type=int, help="runs per server and workload (default: 1 quick, 2 full)")
    parser.add_argument("--streams", help="throughput: comma-separated agent counts (default: 1,4,8,16 full, 1,4 quick)")
    parser.add_argument("--peer", choices=("tuned", "defaults"), default="tuned",
                        help="tuned: mlx_lm.server with its batching set equal to semantic's and a prompt cache "
                             "sized like semantic's pool (the default); defaults: "
                             "`mlx_lm.server --model FOLDER` as users run it")
    parser.add_argument("--api", choices=("chat", "completions"), default="chat",
                        help="chat: turns as chat completions (the default); completions: each turn's messages as "
                             "one raw prompt to /v1/completions, for a base model with no chat template, which "
                             "both servers then continue alike")
    args = parser.parse_args()
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := [w for w in chosen if w not in WORKLOADS]:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    folder = model_folder(args.model, args.cache_dir)
    sizes = QUICK if args.quick else FULL
    if args.repeats:
        sizes = replace(sizes, repeats=args.repeats)
    if args.streams:
        try:
            streams = tuple(int(n) for n in args.streams.split(","))
        except ValueError:
            parser.error(f"--streams: {args.streams!r} is not a comma-separated list of agent counts")
        if not streams or min(streams) < 1:
            parser.error("--streams: agent counts must be 1 or more")
        sizes = replace(sizes, streams=streams)
    print(f"# model folder {folder}\n# {'quick' if args.quick else 'full'} sizes: {sizes}")
    print(f"# peer: mlx_lm.server {'at its defaults' if args.peer == 'defaults' else 'tuned (batching as semantic)'}")
    result = BenchResult("bench_vs_mlx_lm_server", "semantic vs mlx_lm.server",
                         args={"model": args.model, "quick": args.quick, "workloads": chosen, "sizes": str(sizes),
                               "peer": args.peer, "api": args.api})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-vs-mlx-lm-") as work:
        bench = Bench(folder, Tokenizer.from_file(str(folder / "tokenizer.json")), Batching(), args.pool_mb,
                      Path(work), sizes, result, peer_at_defaults=args.peer == "defaults",
                      raw_prompts=args.api == "completions")
        for name in chosen:
            WORKLOADS[name](bench)
            result.duration_s = time.perf_counter() - started
            result.write(args.json)  # after every workload: a later failure keeps the finished ones
    print(f"# finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
