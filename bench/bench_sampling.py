"""The cost of drawing one token per row with top-p / top-k, per backend, against greedy and mlx-lm's sampler.

The engine's sampler (engine/runtime/runner/sampling.py) partitions the vocabulary for
top_k, sorts only the k survivors for top_p, and draws each row with its own
PRNG key. This times it, mlx-lm's ``make_sampler`` and greedy on the same
logits, and the two vocabulary-wide ops it rests on, for real vocabulary
sizes at 1 and 16 rows; and the first draw of each shape apart (on CUDA the
first use of a kernel compiles it: an H100 step profile without a sampled
warm-up once showed 215 ms sampled steps against 13 ms greedy, all of it
first-use cost, which this bench shows separately).

No model is loaded: the logits are random with a model-like spread.

Run: ``LD_PRELOAD=... python -m bench.bench_sampling [--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from bench.common import print_table
from bench.results import BenchResult, recorded

from engine.runtime.runner import sampling
from engine.domain.requests import SamplingParams

VOCABS = {"SmolLM2 (49,152)": 49152, "Llama 3 (128,256)": 128256, "Gemma 3 (262,144)": 262144}
ROWS = (1, 16)
PARAMS = SamplingParams(temperature=0.7, top_p=0.95, top_k=40, seed=0)


def first_ms(fn: Callable[[], mx.array]) -> float:
    """The first draw of a shape: kernel compilation (CUDA), allocation."""
    start = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - start) * 1000


def timed_ms(fn: Callable[[], mx.array], repeats: int) -> float:
    mx.eval(fn())  # warm-up: kernels compiled, buffers allocated
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def engine_sample(logits: mx.array) -> Callable[[], mx.array]:
    samplers = [sampling.RowSampler(PARAMS) for _ in range(logits.shape[0])]
    return lambda: sampling.sample(logits, samplers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed draws per cell (default 20)")
    parser.add_argument("--quick", action="store_true", help="5 draws per cell")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--model", help="ignored (no model is loaded); accepted so run scripts can pass it")
    parser.add_argument("--pool-mb", help="ignored, as --model")
    args = parser.parse_args()
    repeats = 5 if args.quick else args.repeats
    device = mx.default_device()
    result = BenchResult("bench_sampling", "Sampling one token per row (engine vs mlx-lm)",
                         {"repeats": repeats, "device": str(device)})
    mlx_lm_sampler = make_sampler(temp=PARAMS.temperature, top_p=PARAMS.top_p, top_k=PARAMS.top_k)
    rows_out = []
    with recorded(result, args.json):
        for name, vocab in VOCABS.items():
            for rows in ROWS:
                logits = mx.random.normal((rows, vocab)) * 3
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                mx.eval(logits, logprobs)
                draw = engine_sample(logits)
                cells = {
                    "engine, first draw": first_ms(draw),
                    "engine": timed_ms(draw, repeats),
                    "greedy": timed_ms(lambda: mx.argmax(logits, axis=-1), repeats),
                    "mlx-lm make_sampler": timed_ms(lambda: mlx_lm_sampler(logprobs), repeats),
                    "argpartition": timed_ms(lambda: mx.argpartition(-logprobs, kth=PARAMS.top_k - 1, axis=-1),
                                             repeats),
                    "argsort": timed_ms(lambda: mx.argsort(-logprobs, axis=-1), repeats),
                }
                group = f"{name}, {rows} row{'s' * (rows > 1)} (ms per draw)"
                for key, value in cells.items():
                    result.metric(group, key, value, "ms", better="lower")
                rows_out.append([name, rows, *cells.values()])
                print(f"# {group}: " + ", ".join(f"{k} {v:.2f}" for k, v in cells.items()), flush=True)
        print(f"\n## Sampling on {device} (temperature 0.7, top_p 0.95, top_k 40), median ms per draw")
        print_table(["vocabulary", "rows", "engine first draw", "engine", "greedy", "mlx-lm sampler",
                     "argpartition", "argsort"], rows_out)
        result.notes.append(f"Device {device}. Logits random normal x3; median of {repeats} draws after one "
                            "warm-up, and the first draw of each shape apart.")


if __name__ == "__main__":
    main()
