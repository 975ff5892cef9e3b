"""Which part of an 8-bit K/V cache costs greedy agreement, and would another grouping help?

bench_kv_at_rest measures the shipped ``--kv-bits-at-rest 8`` (K and V grouped
along the head dimension, 64 values per scale and bias) end to end through
the engine; its agreement missed the 95% target. This isolates the cause in
plain mlx-lm, no engine: each prompt is prefilled at full precision but its
last token, the cache's K and V are quantized and dequantized one of several
ways, and the greedy continuation is compared with the unquantized one:

- ``per-token``: K and V as shipped;
- ``per-channel K``: K grouped along the tokens instead (one scale per
  channel per 64 tokens, as KIVI does for keys, whose outliers sit in fixed
  channels), V as shipped;
- ``K full``: K left at full precision, V as shipped;
- ``V full``: K as shipped, V left at full precision.

Agreement as in bench_kv_at_rest: the share of tokens before the first divergence.

Run: ``LD_PRELOAD=... python -m bench.bench_kv_quant_variants [--model M] [--prompts N] [--tokens N] [--json PATH]``.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from bench.bench_kv_at_rest import agreement, code_prompts
from bench.common import base_parser, load, print_table
from bench.results import BenchResult, recorded

BITS = 8
GROUP = 64
Transform = Callable[[mx.array], mx.array]


def per_token(a: mx.array) -> mx.array:
    """Groups along the head dimension (the shipped layout)."""
    packed, scales, biases = mx.quantize(a, group_size=GROUP, bits=BITS)
    return mx.dequantize(packed, scales, biases, group_size=GROUP, bits=BITS)


def per_channel(a: mx.array) -> mx.array:
    """Groups along the tokens, per channel; the tail padded with its last token to a whole group."""
    tokens = a.shape[2]
    pad = (-tokens) % GROUP
    t = mx.swapaxes(a, 2, 3)
    if pad:
        t = mx.concatenate([t, mx.repeat(t[..., -1:], pad, axis=-1)], axis=-1)
    packed, scales, biases = mx.quantize(t, group_size=GROUP, bits=BITS)
    back = mx.dequantize(packed, scales, biases, group_size=GROUP, bits=BITS)
    return mx.swapaxes(back[..., :tokens], 2, 3)


def unchanged(a: mx.array) -> mx.array:
    return a


VARIANTS: dict[str, tuple[Transform, Transform]] = {
    "per-token (shipped)": (per_token, per_token),
    "per-channel K": (per_channel, per_token),
    "K full": (unchanged, per_token),
    "V full": (per_token, unchanged),
}


def continuation(model, prompt: tuple[int, ...], base: list[tuple[mx.array, mx.array]], keys: Transform,
                 values: Transform, tokens: int) -> list[int]:
    cache = []
    for k, v in base:
        layer = KVCache()
        layer.update_and_fetch(keys(k), values(v))
        cache.append(layer)
    steps = generate_step(mx.array([prompt[-1]]), model, prompt_cache=cache, max_tokens=tokens)
    return [token for token, _ in steps]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts (default 10)")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per continuation (default 128)")
    parser.add_argument("--context", type=int, default=600, help="tokens of source code per prompt (default 600)")
    args = parser.parse_args()
    n_prompts, tokens = (2, 32) if args.quick else (args.prompts, args.tokens)
    result = BenchResult("bench_kv_quant_variants", "Where 8-bit K/V error comes from",
                         {"model": args.model, "prompts": n_prompts, "tokens": tokens, "bits": BITS, "group": GROUP})
    with recorded(result, args.json):
        loaded = load(args)
        model = loaded.model
        prompts = code_prompts(loaded, n_prompts, args.context)
        found: dict[str, list[tuple[int, float]]] = {name: [] for name in VARIANTS}
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            cache = [KVCache() for _ in model.layers]
            model(mx.array([prompt[:-1]]), cache=cache)
            base = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in cache]
            mx.eval(base)
            reference = continuation(model, prompt, base, unchanged, unchanged, tokens)
            for name, (keys, values) in VARIANTS.items():
                found[name].append(agreement(reference, continuation(model, prompt, base, keys, values, tokens)))
            print(f"# prompt {i + 1}/{len(prompts)} after {time.perf_counter() - started:.0f} s: first divergence "
                  + ", ".join(f"{name} {found[name][-1][0]}" for name in VARIANTS), flush=True)
        rows = []
        for name, matches in found.items():
            rate = sum(share for _, share in matches) / len(matches)
            identical = sum(share == 1.0 for _, share in matches)
            rows.append([name, 100 * rate, f"{identical}/{len(matches)}", " ".join(str(f) for f, _ in matches)])
            group = f"8-bit, groups of {GROUP}: {name}"
            result.metric(group, "greedy agreement with full precision", 100 * rate, "%", better="higher")
            result.metric(group, "continuations identical", identical, "prompts", better="higher")
        print(f"\n## {len(prompts)} prompts x {tokens} greedy tokens, {BITS}-bit, groups of {GROUP}")
        print_table(["K / V at rest", "agreement %", "identical", "first divergence per prompt"], rows)


if __name__ == "__main__":
    main()
