"""A decode step's linear layers at 1-64 rows (one per agent, or agents with their drafts): MLX's matmul, numpy's BLAS and the few-row pass; and one mx.eval.

Times every linear layer of the model once (each weight matrix times a
batch of ``rows`` inputs, what one decode step does), three ways:

- MLX: ``x @ W.T`` per layer, all evaluated together (MLX's CPU matmul,
  ``sgemm``, the path mlx-lm runs);
- numpy: the same product through numpy's BLAS (at one row numpy calls
  ``sgemv``);
- pass: ``engine/runtime/runner/backends/cpu/linear_kernel.py`` (numba), which reads each
  weight once and multiplies it with every row.

The rate is the weights' bytes over the time: at a few rows a linear layer
is bound by reading its weights, so this is the memory rate each way gets.
It also times one ``mx.eval`` of a one-element-per-row operation, the
hand-off to MLX's CPU stream that a decode step pays each time it evaluates
inside the model (``runtime/runner/backends/cpu/host_forward.py``'s reason to leave MLX out).

Run: ``LD_PRELOAD=... python -m bench.bench_linear_pass [--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from bench.common import base_parser, load, median_ms, print_table
from bench.results import BenchResult, recorded

from engine.runtime.runner.backends.cpu import host_linear, linear_kernel

ROWS = (1, 2, 4, 8, 16, 32, 64)


def weights_of(model) -> list[mx.array]:
    """Every linear layer's weight matrix (and a tied output layer's), as the decode step reads them."""
    found = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    embed = [m for _, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if getattr(getattr(model, "args", None), "tie_word_embeddings", False) and embed:
        found.append(embed[0].weight)
    mx.eval(found)
    return found


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per way and row count (median)")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    result = BenchResult("bench_linear_pass", "Linear layers at decode: MLX, numpy BLAS, the few-row pass",
                         {"model": args.model, "rows": list(ROWS), "repeats": repeats})
    with recorded(result, args.json):
        loaded = load(args)
        weights = weights_of(loaded.model)
        hosts = [np.asarray(w) for w in weights]
        total = sum(w.nbytes for w in hosts)
        print(f"# {len(hosts)} weight matrices, {total / 1e6:.0f} MB of {hosts[0].dtype}")
        rng = np.random.default_rng(0)
        table = []
        for rows in ROWS:
            inputs = {w.shape[1]: rng.standard_normal((rows, w.shape[1])).astype(np.float32) for w in hosts}
            mlx_inputs = {k: mx.array(v) for k, v in inputs.items()}
            outs = [np.empty((rows, w.shape[0]), dtype=np.float32) for w in hosts]

            def through_mlx() -> None:
                mx.eval([mlx_inputs[w.shape[1]] @ w.T for w in weights])

            def through_numpy() -> None:
                for w in hosts:
                    inputs[w.shape[1]] @ w.T

            def through_pass() -> None:
                for w, out in zip(hosts, outs):
                    linear_kernel.times_transposed(inputs[w.shape[1]], w, out, host_linear.THREADS)

            ms = {name: median_ms(fn, repeats) for name, fn in
                  (("MLX", through_mlx), ("numpy", through_numpy), ("pass", through_pass))}
            table.append([rows, *(f"{ms[k]:.1f}" for k in ms), *(f"{total / ms[k] / 1e6:.1f}" for k in ms)])
            for name, value in ms.items():
                result.metric(f"all linear layers at {rows} rows (ms)", name, value, "ms", better="lower")
                result.metric(f"weights read at {rows} rows (GB/s)", name, total / value / 1e6, "GB/s")
        print_table(["rows", "MLX ms", "numpy ms", "pass ms", "MLX GB/s", "numpy GB/s", "pass GB/s"], table)
        x = mx.ones((1, 576))
        mx.eval(x)
        evals = 200
        eval_us = 1000 * median_ms(lambda: [mx.eval(x * 1.0001) for _ in range(evals)], repeats) / evals
        print(f"one mx.eval of a 576-element multiply: {eval_us:.0f} us")
        result.metric("MLX CPU stream", "one mx.eval of a 576-element multiply", eval_us, "us", better="lower")


if __name__ == "__main__":
    main()
