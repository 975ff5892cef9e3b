"""Engine throughput and cache-reuse benchmark.

1. Aggregate decode tok/s with 1, 4, 8 and 16 concurrent agents, and the
   ratio to single-stream mlx_lm (``generate_step``) on the same model.
2. Time-to-first-token of an agent's second turn with its cache reused,
   against the same turn sent by a fresh agent (full prefill).

Run: ``make bench`` or ``LD_PRELOAD=... python -m bench.bench_engine [--quick] [--json PATH]``.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream

from bench.common import base_parser, load, median, print_table, start_engine
from bench.results import BenchResult, Series, recorded

from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn, run_turns

TOPICS = ["the ocean", "mountains", "a city at night", "a robot", "autumn", "a library", "trains", "the moon",
          "coffee", "a garden", "rain", "a lighthouse", "chess", "bees", "a desert", "snow"]


def chat(loaded, text: str, history=None) -> tuple[int, ...]:
    messages = (history or []) + [{"role": "user", "content": text}]
    if getattr(loaded.tokenizer, "chat_template", None):
        return tuple(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tuple(loaded.tokenizer.encode("\n".join(m["content"] for m in messages)))


def single_stream_tok_s(loaded, prompt: tuple[int, ...], n: int) -> float:
    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=n)
    next(steps)  # exclude prefill
    t0 = time.perf_counter()
    count = sum(1 for _ in steps)
    mx.synchronize(generation_stream)
    return count / (time.perf_counter() - t0)


def decode_throughput(engine, loaded, concurrency: int, n_tokens: int) -> float:
    """Aggregate generated tokens per second, from the submit (all agents at once) to the last token.

    Every token generated is counted and the window is every second they took,
    prefills included: a window opened at the last agent's first token would
    count tokens made before it opened (an inflated figure).
    """
    requests = [
        GenerationRequest(f"tp-{concurrency}-{i}", chat(loaded, f"Write a long story about {TOPICS[i % 16]}."), n_tokens)
        for i in range(concurrency)
    ]
    results = run_turns(engine, requests, timeout_s=1800)
    window = max(r.finish.usage.duration_s for r in results)  # each from its submit, and all were submitted at once
    generated = sum(r.finish.usage.generated_tokens for r in results)
    return generated / max(window, 1e-6)


def ttft_reuse(engine, loaded, context_tokens: int, repeats: int) -> tuple[float, float, int]:
    filler = " ".join(f"Fact {i}: the value of item {i} is {i * 7 % 101}." for i in range(context_tokens // 12))
    first_prompt = chat(loaded, f"Remember these facts.\n{filler}\nSay OK.")
    with_reuse, without = [], []
    for r in range(repeats):
        agent = f"ttft-{context_tokens}-{r}"
        first = run_turn(engine, GenerationRequest(agent, first_prompt, 8), timeout_s=1800)
        history = [{"role": "user", "content": f"Remember these facts.\n{filler}\nSay OK."},
                   {"role": "assistant", "content": first.text}]
        second_prompt = chat(loaded, "What is the value of item 3?", history)
        second = run_turn(engine, GenerationRequest(agent, second_prompt, 4), timeout_s=1800)
        cold = run_turn(engine, GenerationRequest(f"{agent}-cold", second_prompt, 4), timeout_s=1800)
        assert second.finish.usage.reused_tokens > 0 and cold.finish.usage.reused_tokens == 0
        with_reuse.append(second.finish.usage.ttft_s)
        without.append(cold.finish.usage.ttft_s)
    return median(with_reuse), median(without), len(second_prompt)


CONCURRENCY = (1, 4, 8, 16)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per agent")
    args = parser.parse_args()
    result = BenchResult("bench_engine", "Engine: batching scaling and cache reuse",
                         {"model": args.model, "quick": args.quick, "tokens": args.tokens, "pool_mb": args.pool_mb})
    with recorded(result, args.json):
        loaded = load(args)
        # No prefix sharing: the fresh agent of the reuse test must really prefill, not borrow the first agent's prefix.
        engine = start_engine(loaded, args.pool_mb, prefix_sharing=False)
        try:
            run_turn(engine, GenerationRequest("warmup", chat(loaded, "Hello"), 8))
            throughput_section(engine, loaded, 24 if args.quick else args.tokens, result)
            reuse_section(engine, loaded, args.quick, result)
        finally:
            engine.stop()


def throughput_section(engine, loaded, n_tokens: int, result: BenchResult) -> None:
    baseline = single_stream_tok_s(loaded, chat(loaded, "Write a long story about the sea."), n_tokens)
    print(f"\n## Decode throughput ({n_tokens} tokens per agent)")
    rows = [["mlx_lm generate_step (single stream)", 1, baseline, 1.0]]
    group = "decode throughput"
    result.metric(group, "mlx_lm generate_step, single stream", baseline, "tok/s")
    rates = []
    for concurrency in CONCURRENCY:
        rates.append(decode_throughput(engine, loaded, concurrency, n_tokens))
        rows.append(["semantic engine", concurrency, rates[-1], rates[-1] / baseline])
        agents = f"{concurrency} agent{'s' * (concurrency > 1)}"
        result.metric(group, f"semantic, {agents}", rates[-1], "tok/s")
        result.metric(group, f"semantic, {agents} / single stream", rates[-1] / baseline, "x")
    print_table(["path", "agents", "tok/s", "x single"], rows)
    result.series.append(Series("batching scaling", "concurrent agents", "aggregate decode tok/s", list(CONCURRENCY),
                                {"semantic engine": rates, "mlx_lm single stream": [baseline] * len(rates)}))
    result.notes.append(f"Decode throughput: {n_tokens} tokens per agent, measured from the last agent's first "
                        "token to the last token (all agents decoding); the baseline is mlx_lm's generate_step.")


def reuse_section(engine, loaded, quick: bool, result: BenchResult) -> None:
    print("\n## Second-turn time to first token: cache reuse vs full prefill")
    sizes = (512,) if quick else (512, 2048)
    rows = []
    for size in sizes:
        reuse, fresh, n = ttft_reuse(engine, loaded, size, 1 if quick else 2)
        rows.append([n, reuse, fresh, fresh / reuse])
        group = f"second-turn TTFT, {size}-token context"
        result.metric(group, "prompt tokens", n, "tokens", "neither")
        result.metric(group, "TTFT with cache reuse", reuse, "s", "lower")
        result.metric(group, "TTFT with full prefill", fresh, "s", "lower")
        result.metric(group, "speed-up", fresh / reuse, "x")
    print_table(["prompt tokens", "TTFT reuse s", "TTFT full s", "speed-up x"], rows)
    result.series.append(Series("second-turn TTFT: cache reuse vs full prefill", "second-turn prompt tokens",
                                "TTFT s", [r[0] for r in rows],
                                {"cache reuse": [r[1] for r in rows], "full prefill": [r[2] for r in rows]}, "bar"))

if __name__ == "__main__":
    main()
