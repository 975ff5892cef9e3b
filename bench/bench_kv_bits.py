"""K/V quantized in the hot pool (--kv-bits): agents per budget, decode speed, a crowd that overflows, quality.

Each part runs the engine as ``semantic`` does (the device's compute backend, speculation on), once per setting
(none = full precision, 8 and 4 bits), the settings' order alternating per repeat:

1. capacity: one pool budget that holds ``--fit`` agents of a ``--context``-token conversation at full
   precision; agents (each its own source file of this repository, a one-token reply) arrive one at a time
   until the pool would hold no more, and the hot agents are counted at the end (the rest went to disk);
2. decode: ``--agents`` agents at once, each a distinct ~300-token prompt, ``--tokens`` greedy tokens each:
   aggregate tok/s over the burst (first tokens included);
3. crowd: 16 agents x 3 turns of bench_cache_store's crowded workload on a pool for ``--crowd-fit``
   full-precision agents: wall time, tokens prefilled again, agents hot at the end (``crowd-without-disk``:
   the same with no warm tier, so that a spilled agent prefills its conversation again);
4. quality: perplexity of a fixed text (this repository's README, second half given the first) through
   mlx-lm's forward with its own cache at each setting (QuantizedKVCache: what the pool holds, each position
   packed when written), and greedy agreement through the engine: ``--conversations`` two-turn conversations
   (the second turn's history is full precision's first reply), each reply's first token that differs from
   full precision's; and the perplexity with K and V packed at different widths (K8V4), which the pool does
   not offer, measured over the values such a pool would hold.

Run: ``LD_PRELOAD=... python -m bench.bench_kv_bits [--model gemma3-270m] [--quick] [--json PATH]``.
"""

from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from tempfile import TemporaryDirectory

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from bench.bench_kv_at_rest import code_prompts
from bench.common import ROOT, base_parser, load, print_table
from bench.results import BenchResult, recorded

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest, SamplingParams
from engine.models.loaded import LoadedModel
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.sync_client import run_turn
from engine.settings import BatchSettings, CacheSettings, EngineSettings
from engine.store.stored_model import stored_model
from engine.store.warm_store import WarmStore

SETTINGS: tuple[int | None, ...] = (None, 8, 4)
GREEDY = SamplingParams(temperature=0.0)
QUESTIONS = ["What is a good name for a cat?", "Explain recursion in one sentence.", "Write a haiku about rain.",
             "What does a compiler do?", "Give three uses of a paperclip.", "Why is the sky blue?",
             "Summarize the rules of chess.", "What is the capital of Japan?", "How do plants make food?",
             "Describe a sunset.", "What is a linked list?", "Name two prime numbers above 50.",
             "What does HTTP stand for?", "How do you boil an egg?", "What is inflation?",
             "Suggest a title for a mystery novel.", "What is the speed of sound?", "Why do we sleep?",
             "What is a black hole?", "How does a bicycle stay upright?"]


def label(bits: int | None) -> str:
    return "none (full precision)" if bits is None else f"{bits}-bit"


def at_bits(loaded: LoadedModel, bits: int | None) -> LoadedModel:
    return replace(loaded, spec=loaded.spec.with_hot_kv(bits, 64))


def start(loaded: LoadedModel, pool_bytes: int, root: Path | None = None, batch: int = 16) -> Engine:
    store = WarmStore(root, stored_model(loaded), 1 << 40, EventLog()) if root is not None else None
    settings = EngineSettings(cache=CacheSettings(pool_bytes, prefix_sharing=False), batch=BatchSettings(batch, 512))
    engine = Engine(loaded, settings, store=store)
    engine.start()
    return engine


def orders(repeats: int) -> list[tuple[int | None, ...]]:
    """The settings in alternating order, one tuple per repeat."""
    return [SETTINGS if r % 2 == 0 else tuple(reversed(SETTINGS)) for r in range(repeats)]


# -- 1: capacity ------------------------------------------------------------------------------------
def capacity(loaded: LoadedModel, context: int, fit: int, result: BenchResult) -> None:
    print(f"\n## Capacity: one pool budget for {fit} agents of {context} tokens at full precision")
    budget = fit * loaded.spec.bytes_for_tokens(context + 64)
    # Per setting, arrivals until one more would not fit, and one past it (which spills the oldest idle agent).
    needed = {bits: budget // at_bits(loaded, bits).spec.bytes_for_tokens(context + 64) + 1 for bits in SETTINGS}
    prompts = code_prompts(loaded, max(needed.values()), context)
    rows, hot_at = [], {}
    for bits in SETTINGS:
        packed = at_bits(loaded, bits)
        arrivals = needed[bits]
        with TemporaryDirectory() as root:
            engine = start(packed, budget, Path(root))
            try:
                t0 = time.perf_counter()
                for i, prompt in enumerate(prompts[:arrivals]):
                    run_turn(engine, GenerationRequest(f"cap-{i}", prompt, 1, GREEDY), timeout_s=3600)
                elapsed = time.perf_counter() - t0
                snap = engine.fresh_snapshot()
            finally:
                engine.stop()
        hot_at[bits] = snap.tiers.hot_agents
        per_token = packed.spec.bytes_for_tokens(context) / context
        rows.append([label(bits), arrivals, snap.tiers.hot_agents, snap.tiers.warm_agents, f"{per_token / 1024:.1f}",
                     f"{hot_at[bits] / hot_at[None]:.2f}x", f"{elapsed:.0f}"])
        result.metric("capacity", f"hot agents {label(bits)}", snap.tiers.hot_agents, "agents")
        if bits is not None:
            target = 1.9 if bits == 8 else 3.5
            result.metric("capacity", f"hot agents vs full precision, {label(bits)}", hot_at[bits] / hot_at[None],
                          "x", target=target)
    print_table(["K/V", "agents arrived", "hot at the end", "on disk", "KiB a token", "vs full", "s"], rows)


# -- 2: decode -------------------------------------------------------------------------------------
def decode(loaded: LoadedModel, agents: int, tokens: int, repeats: int, result: BenchResult) -> None:
    print(f"\n## Decode: {agents} agents at once, {tokens} greedy tokens each")
    prompts = code_prompts(loaded, agents, 300)
    rates: dict[int | None, list[float]] = {bits: [] for bits in SETTINGS}
    for order in orders(repeats):
        for bits in order:
            packed = at_bits(loaded, bits)
            engine = start(packed, 4 * agents * packed.spec.bytes_for_tokens(300 + tokens))
            try:
                run_turn(engine, GenerationRequest("warm-up", prompts[0][:64], 4, GREEDY))
                t0 = time.perf_counter()
                with ThreadPoolExecutor(agents) as pool:
                    done = list(pool.map(lambda i: run_turn(engine, GenerationRequest(
                        f"d{i}", prompts[i], tokens, GREEDY), timeout_s=3600), range(agents)))
                elapsed = time.perf_counter() - t0
            finally:
                engine.stop()
            rates[bits].append(sum(len(r.tokens) for r in done) / elapsed)
    rows = []
    for bits in SETTINGS:
        ratios = [r / f for r, f in zip(rates[bits], rates[None])]
        rows.append([label(bits), " / ".join(f"{r:.1f}" for r in rates[bits]), f"{statistics.median(ratios):.2f}x"])
        result.metric("decode", f"aggregate tok/s {label(bits)}", statistics.median(rates[bits]), "tok/s")
        if bits is not None:
            result.metric("decode", f"tok/s vs full precision, {label(bits)}", statistics.median(ratios), "x",
                          target=0.9 if bits == 8 else None)
    print_table(["K/V", "tok/s per repeat", "vs full (median)"], rows)


# -- 3: crowd --------------------------------------------------------------------------------------
def crowd(loaded: LoadedModel, context: int, fit: int, repeats: int, result: BenchResult, disk: bool = True) -> None:
    """``disk``: spills go to a warm tier on disk (and come back from it); else there is none, and a spilled
    agent's next turn prefills its conversation again (a server run without a cache directory)."""
    from bench.bench_cache_store import _crowd

    where = "" if disk else ", no warm tier (spills dropped)"
    print(f"\n## Crowd: 16 agents x 3 turns of ~{context} tokens on a pool for {fit} full-precision agents{where}")
    budget = fit * loaded.spec.bytes_for_tokens(context + 150)
    times: dict[int | None, list[float]] = {bits: [] for bits in SETTINGS}
    rows = []
    part = "crowd" if disk else "crowd without disk"
    for order in orders(repeats):
        for bits in order:
            with TemporaryDirectory() as root:
                engine = start(at_bits(loaded, bits), budget, Path(root) if disk else None)
                try:
                    total, prompt, prefilled, reused, share = _crowd(engine, loaded, 16, 3, context)
                    snap = engine.fresh_snapshot()
                finally:
                    engine.stop()
            times[bits].append(total)
            rows.append([label(bits), f"{total:.1f}", prefilled, f"{share:.1f}%", snap.tiers.hot_agents,
                         snap.tiers.warm_agents])
    print_table(["K/V", "wall s", "prefilled", "reused", "hot at end", "on disk"], rows)
    for bits in SETTINGS:
        result.metric(part, f"wall time {label(bits)}", statistics.median(times[bits]), "s", better="lower")
        if bits is not None:
            speedup = statistics.median([f / b for f, b in zip(times[None], times[bits])])
            result.metric(part, f"faster than full precision, {label(bits)}", speedup, "x",
                          target=1.5 if disk else None)


# -- 4: quality -------------------------------------------------------------------------------------
def perplexity(loaded: LoadedModel, bits: int | None, tokens: list[int]) -> float:
    """The second half's perplexity given the first, each position's K/V as the pool at ``bits`` holds it."""
    caches = [QuantizedKVCache(group_size=64, bits=bits) if bits is not None and type(c) is KVCache else c
              for c in loaded.model.make_cache()]
    return _perplexity_over(loaded, caches, tokens)


def _perplexity_over(loaded: LoadedModel, caches: list, tokens: list[int]) -> float:
    half = len(tokens) // 2
    for i in range(0, half, 512):
        loaded.model(mx.array([tokens[i:min(i + 512, half)]]), cache=caches)
        mx.eval([c.state for c in caches])
    losses = []
    for i in range(half, len(tokens) - 1, 512):
        chunk = tokens[i:min(i + 512, len(tokens) - 1)]
        logits = loaded.model(mx.array([chunk]), cache=caches)[0]
        targets = mx.array(tokens[i + 1:i + 1 + len(chunk)])
        losses.append(nn.losses.cross_entropy(logits, targets, reduction="sum"))
        mx.eval(losses[-1], [c.state for c in caches])
    return math.exp(sum(float(x) for x in losses) / (len(tokens) - 1 - half))


class RoundedKV(KVCache):
    """mlx-lm's KVCache holding each position's K and V as a pool packing K at ``k_bits`` and V at ``v_bits`` would
    give them back (``mx.quantize`` then ``mx.dequantize`` once, when written): the values such a pool attends
    over, for a pairing the pool does not offer (K8V4)."""

    def __init__(self, k_bits: int, v_bits: int, group_size: int = 64) -> None:
        super().__init__()
        self.k_bits, self.v_bits, self.group_size = k_bits, v_bits, group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return super().update_and_fetch(self._rounded(keys, self.k_bits), self._rounded(values, self.v_bits))

    def _rounded(self, x: mx.array, bits: int) -> mx.array:
        packed = mx.quantize(x, group_size=self.group_size, bits=bits)
        return mx.dequantize(*packed, group_size=self.group_size, bits=bits).astype(x.dtype)


def rounded_perplexity(loaded: LoadedModel, k_bits: int, v_bits: int, tokens: list[int]) -> float:
    """:func:`perplexity` with K rounded as ``k_bits`` and V as ``v_bits`` would pack them (RoundedKV)."""
    caches = [RoundedKV(k_bits, v_bits) if type(c) is KVCache else c for c in loaded.model.make_cache()]
    return _perplexity_over(loaded, caches, tokens)


def first_difference(reference: list[int], other: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))


def conversations(loaded: LoadedModel, bits: int | None, n: int, tokens: int,
                  history: list[list[int]] | None) -> list[list[int]]:
    """Each conversation's two replies at ``bits``: turn 1 a question, turn 2 a follow-up after full
    precision's first reply (``history``; None: this is the full-precision run, which makes it)."""
    tokenizer = loaded.tokenizer
    engine = start(at_bits(loaded, bits), 4 * n * loaded.spec.bytes_for_tokens(512), batch=n)

    def render(messages: list[dict]) -> tuple[int, ...]:
        return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def one(i: int) -> list[list[int]]:
        first_q = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        first = run_turn(engine, GenerationRequest(f"c{i}", render(first_q), tokens, GREEDY), timeout_s=3600).tokens
        said = history[i] if history is not None else first
        follow = first_q + [{"role": "assistant", "content": tokenizer.decode(said)},
                            {"role": "user", "content": "Say more about that."}]
        second = run_turn(engine, GenerationRequest(f"c{i}", render(follow), tokens, GREEDY), timeout_s=3600).tokens
        return [first, second]

    try:
        with ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(one, range(n)))
    finally:
        engine.stop()
    return [r for pair in replies for r in pair]


def quality(loaded: LoadedModel, n: int, tokens: int, result: BenchResult) -> None:
    print(f"\n## Quality: perplexity of the README's second half; {n} two-turn conversations, {tokens} tokens a reply")
    text = loaded.tokenizer.encode((ROOT / "README.md").read_text())[:4096]
    if not getattr(loaded.tokenizer, "chat_template", None):
        print("# (no chat template: greedy agreement skipped)")
    reference = conversations(loaded, None, n, tokens, None) if getattr(loaded.tokenizer, "chat_template", None) else None
    rows = []
    for bits in SETTINGS:
        ppl = perplexity(loaded, bits, text)
        result.metric("quality", f"perplexity {label(bits)}", ppl, "", better="lower")
        agree = "-"
        if reference is not None and bits is not None:
            firsts_by_turn = [[], []]
            replies = conversations(loaded, bits, n, tokens, reference[0::2])
            for k, (ref, got) in enumerate(zip(reference, replies)):
                firsts_by_turn[k % 2].append(first_difference(ref, got))
            whole = [sum(f == len(r) for f, r in zip(firsts_by_turn[t], reference[t::2])) for t in (0, 1)]
            medians = [statistics.median(f) for f in firsts_by_turn]
            agree = (f"turn 1: {whole[0]}/{n} identical, first difference at median {medians[0]:.0f}; "
                     f"turn 2: {whole[1]}/{n}, median {medians[1]:.0f}")
            result.metric("quality", f"replies identical to full precision, {label(bits)}", (whole[0] + whole[1]) / (2 * n),
                          "share")
            result.metric("quality", f"first difference, median token, {label(bits)}",
                          statistics.median(firsts_by_turn[0] + firsts_by_turn[1]), "tokens")
        rows.append([label(bits), f"{ppl:.3f}", agree])
    # K and V apart, measured with the values such a pool would hold (the pool packs both at one width); 8 and 8
    # the same way, beside the packed cache's 8-bit row, shows what the rounding alone gives.
    for k_bits, v_bits in ((8, 4), (8, 8)):
        ppl = rounded_perplexity(loaded, k_bits, v_bits, text)
        name = f"K{k_bits}V{v_bits} (values rounded, not offered)" if k_bits != v_bits else "K8V8 (values rounded)"
        result.metric("quality", f"perplexity {name}", ppl, "", better="lower")
        rows.append([name, f"{ppl:.3f}", "-"])
    print_table(["K/V", "perplexity", "greedy agreement with full precision"], rows)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096, help="tokens of a capacity agent's conversation")
    parser.add_argument("--fit", type=int, default=2, help="full-precision agents the capacity pool holds")
    parser.add_argument("--agents", type=int, default=8, help="agents decoding at once")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each decoding agent generates")
    parser.add_argument("--crowd-context", type=int, default=1000, help="tokens of a crowd agent's notes")
    parser.add_argument("--crowd-fit", type=int, default=6, help="full-precision agents the crowd's pool holds")
    parser.add_argument("--conversations", type=int, default=20, help="two-turn conversations compared")
    parser.add_argument("--reply-tokens", type=int, default=48, help="tokens of a compared reply")
    parser.add_argument("--repeats", type=int, default=2, help="repeats of the decode and crowd parts")
    parser.add_argument("--parts", default="capacity,decode,crowd,quality",
                        help="which parts to run (also: crowd-without-disk, the crowd with no warm tier)")
    args = parser.parse_args()
    if args.quick:
        args.context, args.tokens, args.crowd_context, args.conversations, args.repeats = 1024, 32, 300, 4, 1
    loaded = load(args)
    parts = set(args.parts.split(","))
    result = BenchResult("bench_kv_bits", "K/V quantized in the hot pool (--kv-bits)", vars(args) | {
        "cache_dir": str(args.cache_dir), "json": str(args.json), "model_id": loaded.model_id})
    with recorded(result, args.json):
        print(f"# {loaded.model_id}: {at_bits(loaded, 8).spec.hot_kv_summary()}")
        if "capacity" in parts:
            capacity(loaded, args.context, args.fit, result)
        if "decode" in parts:
            decode(loaded, args.agents, args.tokens, args.repeats, result)
        if "crowd" in parts:
            crowd(loaded, args.crowd_context, args.crowd_fit, args.repeats, result)
        if "crowd-without-disk" in parts:
            crowd(loaded, args.crowd_context, args.crowd_fit, args.repeats, result, disk=False)
        if "quality" in parts:
            quality(loaded, args.conversations, args.reply_tokens, result)


if __name__ == "__main__":
    main()
