"""K/V quantized at rest (--kv-bits-at-rest): warm file size, restore time, greedy agreement, perplexity.

For each setting (none = full precision, 8 and 4 bits) a fresh engine with
its own warm tier:

1. prefills ``--prompts`` agents (code from this repository, ``--context``
   tokens each; SmolLM2 asked to explain it through its chat template, Gemma 3,
   a base model, continuing it), then evicts every agent to disk (warm) or,
   quantized, to memory (cool);
2. brings each agent back alone (a one-token turn: read, dequantize, install,
   one token of prefill) and times it; the file sizes give bytes per token;
3. decodes ``--tokens`` greedy tokens for all agents at once from the
   restored caches.

A second part, the crowd: 16 agents x 3 turns of bench_cache_store's
crowded workload on a pool for ~6 full-precision agents (``--crowd-fit``), at each setting
(cooling idle agents in memory before spilling them): total time, tokens
prefilled again, and how many agents the pool holds at the end (hot + cool),
per GiB of pool.

Greedy agreement compares step 3 with the full-precision run, prompt by
prompt, two ways:

- free-running (through the engine): the share of tokens generated before the
  first divergence, and the first divergence position. One near-tied choice
  that flips makes the rest of the answer another answer, so this counts
  every token after it as lost;
- teacher-forced (per token): every prompt's cache quantized and
  dequantized as the engine does, then the full-precision answer fed
  through it in one forward pass; the share of positions whose greedy choice
  (argmax) equals the one the full-precision cache makes on the same input.
  Each position is judged on its own, so a flip costs one token, not the
  rest of the answer.

Perplexity: a fixed text (this repository's
README) cut in two; the second half's perplexity given the first half's
cache as computed, and as it comes back from 8 and 4 bits (mlx-lm forward,
the engine's own quantize/dequantize).

Run: ``LD_PRELOAD=... python -m bench.bench_kv_at_rest [--model gemma3-270m] [--quick] [--json PATH]``.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from bench.common import ROOT, base_parser, load, print_table, start_engine
from bench.results import BenchResult, recorded

from engine.runtime.tiers.agents import Tier
from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest, SamplingParams
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.cache_file import KVQuantization
from engine.store.kv_at_rest import quantization_for, round_trip
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model

SETTINGS = (None, 8, 4)
NOISE = "noise"  # full precision, prefilled in smaller chunks: how often greedy answers flip without quantizing
NOISE_PREFILL_STEP = 128
GREEDY = SamplingParams(temperature=0.0)
SOURCE_GLOB = "engine/**/*.py"


def label(bits: int | str | None) -> str:
    if bits == NOISE:
        return f"none, prefilled in {NOISE_PREFILL_STEP}-token chunks"
    return "none (full precision)" if bits is None else f"{bits}-bit"


# -- prompts ------------------------------------------------------------------------------------
def code_prompts(loaded, n: int, context: int) -> list[tuple[int, ...]]:
    """``n`` prompts of about ``context`` tokens, each from another source file of this repository."""
    tokenizer = loaded.tokenizer
    templated = bool(getattr(tokenizer, "chat_template", None))
    prompts = []
    for path in sorted(ROOT.glob(SOURCE_GLOB)):
        ids = tokenizer.encode(path.read_text(), add_special_tokens=False)
        if len(ids) < context:
            continue
        chunk = tokenizer.decode(ids[:context])
        if templated:
            messages = [{"role": "user", "content": f"Explain what this code does:\n```python\n{chunk}\n```"}]
            prompts.append(tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
        else:
            prompts.append(tuple(tokenizer.encode(chunk)))
        if len(prompts) == n:
            return prompts
    raise SystemExit(f"only {len(prompts)} files of {SOURCE_GLOB} hold {context} tokens; lower --context")


# -- one setting ---------------------------------------------------------------------------------
def quantization(loaded, bits: int | None, group_size: int | None) -> KVQuantization | None:
    """What --kv-bits-at-rest picks for this model, or the group size asked for."""
    chosen = quantization_for(bits, *loaded.spec.head_dims)
    return KVQuantization(bits, group_size) if chosen is not None and group_size else chosen


def run_setting(loaded, bits: int | None, prompts: list[tuple[int, ...]], tokens: int, pool_mb: float,
                group_size: int | None = None, tier: Tier = Tier.WARM, prefill_step: int = 512) -> dict:
    """Prefill, evict every agent to ``tier`` (warm: a file; cool: quantized in memory), restore each
    alone, then decode all at once."""
    with tempfile.TemporaryDirectory() as root:
        store = WarmStore(Path(root), stored_model(loaded), 1 << 40, EventLog(), kv_bits_at_rest=bits)
        store.quantization = quantization(loaded, bits, group_size)
        engine = start_engine(loaded, pool_mb, batch=max(16, len(prompts)), prefill_step=prefill_step, store=store,
                              prefix_sharing=False, kv_bits=bits)
        engine.call(lambda e: setattr(e.tiers, "cool", store.quantization)).result()
        try:
            agents = [f"agent-{i}" for i in range(len(prompts))]
            with ThreadPoolExecutor(len(agents)) as pool:
                list(pool.map(lambda a, p: run_turn(engine, GenerationRequest(a, p, 1, GREEDY), timeout_s=3600),
                              agents, prompts))
            for agent in agents:
                engine.call(lambda e, a=agent: e.ops.evict_agent(a, tier)).result()
            engine.call(lambda e: e._store.flush()).result()
            placed = {a.agent_id: a.tier for a in engine.fresh_snapshot().agents}
            assert set(placed.values()) == {tier.value}, placed
            if tier is Tier.WARM:
                sizes = engine.call(lambda e: [e._store.entries[a].nbytes for a in agents]).result()
            else:
                sizes = engine.call(lambda e: [e.agents.get(a).stored_bytes for a in agents]).result()
            restores = []
            for agent, prompt in zip(agents, prompts):
                back = run_turn(engine, GenerationRequest(agent, prompt, 1, GREEDY), timeout_s=3600)
                assert back.finish.usage.reused_tokens == len(prompt) - 1, back.finish.usage
                restores.append(back.finish.usage.ttft_s)
            with ThreadPoolExecutor(len(agents)) as pool:
                outputs = list(pool.map(
                    lambda a, p: run_turn(engine, GenerationRequest(a, p, tokens, GREEDY), timeout_s=3600).tokens,
                    agents, prompts))
            read_s = store.stats.read_seconds / max(store.stats.reads, 1)
        finally:
            engine.stop()
    n_tokens = sum(len(p) for p in prompts)
    return {"bits": bits, "file_bytes": sizes, "bytes_per_token": sum(sizes) / n_tokens, "restore_s": restores,
            "read_s": read_s, "outputs": outputs}


def agreement(reference: list[int], other: list[int]) -> tuple[int, float]:
    """First divergence position, and the share of the longer answer generated before it."""
    if reference == other:
        return len(reference), 1.0
    first = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    return first, first / max(len(reference), len(other))


# -- the crowd ------------------------------------------------------------------------------------
def crowd(loaded, bits: int | None, n_agents: int, turns: int, context: int, fit: int) -> list:
    from bench.bench_cache_store import _crowd  # the same workload as its crowded-pool section

    blocks_per_agent = loaded.spec.total_blocks_for_tokens(context + 150)
    pool_mb = fit * blocks_per_agent * loaded.spec.block_bytes / 2**20
    with tempfile.TemporaryDirectory() as root:
        store = WarmStore(Path(root), stored_model(loaded), 1 << 40, EventLog(), kv_bits_at_rest=bits)
        engine = start_engine(loaded, pool_mb, store=store, kv_bits=bits)
        try:
            total, prompt, prefilled, reused, _ = _crowd(engine, loaded, n_agents, turns, context)
            snap = engine.fresh_snapshot()
            evictions = engine.call(lambda e: dict(e.tiers.evictions)).result()
        finally:
            engine.stop()
    resident = snap.tiers.hot_agents + snap.tiers.cool_agents
    stats = store.stats
    # Where a turn's restore came from and what the moves cost: what decides whether cooling pays.
    return [label(bits), total, prefilled, reused, snap.tiers.hot_agents, snap.tiers.cool_agents,
            snap.tiers.warm_agents, resident / (pool_mb / 1024), evictions.get("cool", 0), evictions["warm"],
            stats.reads, stats.read_seconds, stats.writes, stats.write_seconds]


# -- teacher-forced agreement ---------------------------------------------------------------------
def quantized_in_place(cache: list, q: KVQuantization | None) -> None:
    """Each layer's K and V through the engine's quantize and dequantize (as a cool or warm restore)."""
    if q is None:
        return
    for layer in cache:
        layer.keys, layer.values = round_trip(layer.keys, q), round_trip(layer.values, q)


def greedy_choices(loaded, prompt: tuple[int, ...], answer: list[int], q: KVQuantization | None) -> list[int]:
    """The argmax at every position of ``answer`` fed after ``prompt``, with the prompt's cache (its
    last token excepted, as the engine re-feeds it) quantized by ``q``."""
    cache = make_prompt_cache(loaded.model)
    for i in range(0, len(prompt) - 1, 512):
        loaded.model(mx.array([prompt[i:min(i + 512, len(prompt) - 1)]]), cache=cache)
        mx.eval([c.state for c in cache])
    quantized_in_place(cache, q)
    logits = loaded.model(mx.array([[prompt[-1], *answer[:-1]]]), cache=cache)
    return mx.argmax(logits[0], axis=-1).tolist()


def teacher_forced(loaded, prompts: list[tuple[int, ...]], answers: list[list[int]],
                   group_size: int | None) -> dict[int | None, list[float]]:
    """Per setting, per prompt: the share of the full-precision answer's positions where the greedy
    choice with the cache at rest equals the one with the full-precision cache."""
    out: dict[int | None, list[float]] = {bits: [] for bits in SETTINGS}
    for prompt, answer in zip(prompts, answers):
        if not answer:
            continue
        choices = {bits: greedy_choices(loaded, prompt, answer, quantization(loaded, bits, group_size))
                   for bits in SETTINGS}
        for bits in SETTINGS:
            same = sum(a == b for a, b in zip(choices[bits], choices[None]))
            out[bits].append(same / len(answer))
    return out


# -- perplexity ----------------------------------------------------------------------------------
def perplexities(loaded, text_tokens: int, group_size: int | None = None) -> dict[int | None, float]:
    ids = loaded.tokenizer.encode((ROOT / "README.md").read_text())[:text_tokens]
    half = len(ids) // 2
    out = {}
    for bits in SETTINGS:
        cache = make_prompt_cache(loaded.model)
        loaded.model(mx.array([ids[:half]]), cache=cache)
        mx.eval([c.state for c in cache])
        quantized_in_place(cache, quantization(loaded, bits, group_size))
        logits = loaded.model(mx.array([ids[half - 1:-1]]), cache=cache)
        nll = nn.losses.cross_entropy(logits[0].astype(mx.float32), mx.array(ids[half:]), reduction="mean")
        out[bits] = math.exp(float(nll))
    return out


def crowd_part(loaded, args, result: BenchResult) -> None:
    n_agents, turns, context, fit = (8, 2, 300, 4) if args.quick else (16, 3, 500, args.crowd_fit)
    rows = [crowd(loaded, bits, n_agents, turns, context, fit) for bits in SETTINGS]
    print(f"\n## {loaded.model_id}: {n_agents} agents x {turns} turns on a pool for ~{fit} full-precision agents")
    print_table(["K/V at rest", "total s", "prefilled tokens", "reused tokens", "hot", "cool", "warm",
                 "resident agents per GiB", "cooled", "spilled to disk", "disk reads", "read s", "disk writes",
                 "write s"], rows)
    for name, total, prefilled, reused, hot, cool, warm, per_gib, cooled, spilled, reads, read_s, _, _ in rows:
        group = f"{loaded.model_id}, {n_agents} agents x {turns} turns on a pool for ~{fit}: K/V at rest {name}"
        result.metric(group, "total time", total, "s", "lower")
        result.metric(group, "prefilled tokens", prefilled, "tokens", "lower")
        result.metric(group, "agents resident at the end (hot + cool)", hot + cool, "agents", "neither")
        result.metric(group, "resident agents per GiB of pool", per_gib, "agents")
        result.metric(group, "agents cooled (quantized in memory)", cooled, "moves", "neither")
        result.metric(group, "agents spilled to disk", spilled, "moves", "neither")
        result.metric(group, "restores read from disk", reads, "reads", "neither")
        result.metric(group, "disk read time, total", read_s, "s", "lower")
    result.metric(f"{loaded.model_id}, crowd", "8-bit at rest speed-up (total time, none / 8-bit)",
                  rows[0][1] / rows[1][1], "x", target=1.0)


def agreement_part(loaded, args, result: BenchResult) -> None:
    prompts = code_prompts(loaded, args.prompts, args.context)
    runs = {}
    for bits in SETTINGS:
        for tier in (Tier.WARM,) if bits is None else (Tier.COOL, Tier.WARM):
            started = time.perf_counter()
            runs[bits, tier] = run_setting(loaded, bits, prompts, args.tokens, args.pool_mb, args.group_size, tier)
            print(f"# {label(bits)} from {tier.value}: {time.perf_counter() - started:.0f} s")
    # The noise floor: the same full-precision caches computed in other prefill chunks (other float sums).
    runs[NOISE, Tier.WARM] = run_setting(loaded, None, prompts, args.tokens, args.pool_mb, tier=Tier.WARM,
                                         prefill_step=NOISE_PREFILL_STEP)
    ppl = perplexities(loaded, args.text_tokens, args.group_size)
    reference = runs[None, Tier.WARM]["outputs"]
    forced = teacher_forced(loaded, prompts, reference, args.group_size)
    rows = []
    for (bits, tier), run in runs.items():
        matches = [agreement(ref, out) for ref, out in zip(reference, run["outputs"])]
        diverged = [first for first, share in matches if share < 1.0]
        rate = statistics.mean(share for _, share in matches)
        where = "on disk (warm)" if tier is Tier.WARM else "in memory (cool)"
        group = f"{loaded.model_id}, K/V at rest {label(bits)}, restored from {where}"
        result.metric(group, "bytes per token " + ("of the warm file" if tier is Tier.WARM else "in memory"),
                      run["bytes_per_token"], "B", "lower")
        result.metric(group, "restore one agent (one-token turn), median", statistics.median(run["restore_s"]),
                      "s", "lower")
        if tier is Tier.WARM:
            result.metric(group, "file read, mean", run["read_s"], "s", "lower")
        result.metric(group, "greedy agreement with full precision, free-running (share before the first "
                      "divergence)", 100 * rate, "%", target=95.0 if bits == 8 else None)
        per_token = statistics.mean(forced[bits]) if bits != NOISE else None
        if per_token is not None:
            result.metric(group, "greedy agreement with full precision, teacher-forced (per token)", 100 * per_token,
                          "%", target=95.0 if bits == 8 else None)
            result.metric(group, "teacher-forced agreement, worst prompt", 100 * min(forced[bits]), "%", "neither")
        if diverged:
            result.metric(group, "first divergence of the answers that diverged, min", min(diverged), "tokens",
                          "neither")
            result.metric(group, "first divergence of the answers that diverged, median",
                          statistics.median(diverged), "tokens", "neither")
        result.metric(group, "prompts identical throughout", sum(s == 1.0 for _, s in matches), "prompts", "neither")
        if bits != NOISE:
            result.metric(group, "perplexity of the README's second half", ppl[bits], "", "lower")
        rows.append([label(bits), tier.value, run["bytes_per_token"], statistics.median(run["restore_s"]),
                     run["read_s"] if tier is Tier.WARM else "-",
                     100 * rate, "-" if per_token is None else 100 * per_token,
                     "-" if per_token is None else 100 * min(forced[bits]),
                     f"{len(matches) - len(diverged)} of {len(matches)}",
                     min(diverged) if diverged else "-", statistics.median(diverged) if diverged else "-",
                     ppl.get(bits, "-")])
    print(f"\n## {loaded.model_id}: {args.prompts} prompts of ~{args.context} tokens, {args.tokens} greedy tokens")
    print_table(["K/V at rest", "from", "B/token", "restore s (median)", "read s (mean)", "free-running %",
                 "per token %", "worst prompt %",
                 "identical", "diverged at: min", "median", "perplexity"], rows)
    result.notes.append(
        "Agreement: per prompt, the share of the answer generated before the first token that differs from the "
        "full-precision run's (1.0 when identical), averaged; the full-precision row compares the run with itself. "
        f"The noise-floor row computes the same full-precision caches in {NOISE_PREFILL_STEP}-token prefill chunks "
        "instead of 512: float sums in another order, no quantization. Per token (teacher-forced): the full-precision "
        "answer fed through the quantized cache; the share of positions whose argmax equals the full-precision "
        "cache's on the same input, averaged over prompts (worst prompt beside it).")


# -- the report ----------------------------------------------------------------------------------
def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20, help="agents (prompts) per setting (default 20)")
    parser.add_argument("--tokens", type=int, default=256, help="greedy tokens each agent generates (default 256)")
    parser.add_argument("--context", type=int, default=600, help="tokens of code per prompt (default 600)")
    parser.add_argument("--text-tokens", type=int, default=2048, help="tokens of the perplexity text (default 2048)")
    parser.add_argument("--only", choices=("agreement", "crowd"), help="run one part (default: both)")
    parser.add_argument("--crowd-fit", type=int, default=6,
                        help="the crowd's pool, in full-precision agents (default 6, the issue's; 8 lets the idle "
                             "agents fit once quantized)")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128),
                        help="quantization group size instead of the engine's choice for the head dim")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.tokens, args.context, args.text_tokens = 4, 64, 300, 512
    result = BenchResult("bench_kv_at_rest", "K/V quantized at rest: file size, restore time, agreement, perplexity",
                         {"model": args.model, "quick": args.quick, "prompts": args.prompts, "tokens": args.tokens,
                          "context": args.context, "text_tokens": args.text_tokens, "group_size": args.group_size})
    with recorded(result, args.json):
        loaded = load(args)
        if args.only != "crowd":
            agreement_part(loaded, args, result)
        if args.only != "agreement":
            crowd_part(loaded, args, result)


if __name__ == "__main__":
    main()
