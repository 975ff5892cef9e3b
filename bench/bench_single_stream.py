"""One agent's decode speed through the engine against mlx-lm's own decode loop (``generate_step``).

The question this answers (issue 15): how much does the engine's machinery
(the batch step, room checks, detokenization, stop strings, the repetition
guard, event delivery to the client) cost one agent per token, against the
tightest loop mlx-lm has for the same model and prompt. On a GPU the step is
bound by the host's work per token, so that machinery shows directly; on this
CPU the model's forward pass dominates both.

Both sides decode the same prompt for the same number of tokens (greedy by
default; ``--temperature`` samples on both, for random-weight models whose
greedy output loops); the rate is tokens after the first over the time from
the first token to the last, as the client receives them (the engine's through
its event sink, ``generate_step``'s as it yields). Runs alternate engine /
mlx-lm, and the ratio is taken per pair.

Run: ``LD_PRELOAD=... python -m bench.bench_single_stream [--model M] [--tokens N] [--repeats R] [--json PATH]``.
"""

from __future__ import annotations

import json
import queue
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.sample_utils import make_sampler

from bench.common import base_parser, load, print_table, start_engine
from bench.results import BenchResult, recorded

from engine.domain.requests import FinishEvent, GenerationRequest, SamplingParams, TokenEvent

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def prompt_tokens(loaded) -> tuple[int, ...]:
    tokenizer = loaded.tokenizer
    if getattr(tokenizer, "chat_template", None):
        return tuple(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    return tuple(tokenizer.encode(PROMPT))


def default_temperature(loaded) -> float:
    """Greedy, except on a random-weight model (bench/random_model.py), whose greedy output loops at once."""
    config = loaded.path / "config.json" if loaded.path is not None else None
    if config is not None and config.is_file() and "semantic_random_weights" in json.loads(config.read_text()):
        return 1.0
    return 0.0


def mlx_lm_rate(loaded, prompt: tuple[int, ...], n_tokens: int, temperature: float) -> tuple[float, int]:
    """Tokens/s of ``generate_step`` after its first token (the prefill excluded), and the tokens made."""
    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=n_tokens, sampler=make_sampler(temp=temperature))
    next(steps)
    first = time.perf_counter()
    count = 1 + sum(1 for _ in steps)
    mx.synchronize(generation_stream)
    return (count - 1) / (time.perf_counter() - first), count


def engine_rate(engine, prompt: tuple[int, ...], n_tokens: int, temperature: float, run: int) -> tuple[float, int]:
    """Tokens/s of one agent through the engine, from its first token event to its last, and the tokens made.

    A fresh agent per run, so every run prefills the same prompt as ``generate_step`` does.
    """
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    request = GenerationRequest(f"single-{run}", prompt, n_tokens, SamplingParams(temperature=temperature))
    engine.submit(request, inbox.put)
    stamps: list[float] = []
    while True:
        event = inbox.get(timeout=1800)
        if isinstance(event, TokenEvent):
            stamps.append(time.perf_counter())
        elif isinstance(event, FinishEvent):
            if event.error:
                raise RuntimeError(event.error)
            break
    if len(stamps) < 2:
        raise RuntimeError(f"the engine made {len(stamps)} tokens; the rate needs at least 2")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens to decode per run (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="engine / mlx-lm pairs, alternating order (default 5)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 decodes greedily, above 0 samples on both sides (default: 0, or 1 on a "
                             "random-weight model, whose greedy output loops and would be cut by the repetition guard)")
    args = parser.parse_args()
    n_tokens, repeats = (64, 2) if args.quick else (args.tokens, args.repeats)
    loaded = load(args)
    if args.temperature is None:
        args.temperature = default_temperature(loaded)
    prompt = prompt_tokens(loaded)
    engine = start_engine(loaded, args.pool_mb, batch=16)
    result = BenchResult("bench_single_stream", "One agent: engine vs mlx-lm generate_step")
    try:
        with recorded(result, args.json):
            # Warm-ups of full length: first uses pay for kernel compilation (CUDA) and allocation on both
            # sides, and a cache that grows past a block meets new shapes (two H100 runs with 16-token
            # warm-ups measured their first pair at 0.52x and 0.55x, the rest at 0.85-1.45x).
            engine_rate(engine, prompt, n_tokens, args.temperature, -1)
            mlx_lm_rate(loaded, prompt, n_tokens, args.temperature)
            rows, ratios = [], []
            for r in range(repeats):
                order = ("engine", "mlx_lm") if r % 2 == 0 else ("mlx_lm", "engine")
                measured = {}
                for side in order:
                    measured[side] = (engine_rate(engine, prompt, n_tokens, args.temperature, r) if side == "engine"
                                      else mlx_lm_rate(loaded, prompt, n_tokens, args.temperature))
                ratio = measured["engine"][0] / measured["mlx_lm"][0]
                ratios.append(ratio)
                rows.append([r + 1, measured["engine"][0], measured["engine"][1], measured["mlx_lm"][0],
                             measured["mlx_lm"][1], ratio])
            print(f"\n## One agent, {len(prompt)}-token prompt, {n_tokens} tokens, temperature {args.temperature:g}")
            print_table(["run", "engine tok/s", "engine tokens", "generate_step tok/s", "generate_step tokens",
                         "engine / generate_step"], rows)
            group = "one agent decode"
            result.metric(group, "engine tok/s (median)", statistics.median(r[1] for r in rows), "tok/s")
            result.metric(group, "generate_step tok/s (median)", statistics.median(r[3] for r in rows), "tok/s")
            result.metric(group, "engine / generate_step (median of pairs)", statistics.median(ratios), "x")
            result.metric(group, "engine / generate_step (min)", min(ratios), "x")
            result.notes.append(f"{repeats} alternating pairs, {len(prompt)}-token prompt, {n_tokens} tokens, "
                                f"temperature {args.temperature:g}; rates exclude the prefill and count from the "
                                "first token the client receives to the last.")
            print(f"\nengine / generate_step: median {statistics.median(ratios):.3f}x, min {min(ratios):.3f}x")
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
