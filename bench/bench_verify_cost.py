"""What a speculative step's pass costs as it carries more tokens: the basis of ``draft_row_cost`` and ``draft_token_cost``.

A verification feeds each agent its last token and its drafts in one pass.
On a device with arithmetic to spare, a few more tokens in a pass cost about
nothing (the pass is bound by reading the weights); on this project's 2-core
CPU they are not free. This times one pass of ``width`` tokens per agent, at
1 and 8 agents with ``--context`` tokens cached each, two ways:

- the CPU backend's host path (``host_forward.decode`` with widths: each
  token a row of the linear layers, each agent's tokens attending together,
  ``host_verify_attention.py``), what a Llama-family model runs on the CPU;
- MLX's forward over the same caches (what every other model runs, and the
  host path's fallback).

Run: ``LD_PRELOAD=... python -m bench.bench_verify_cost [--model M] [--context N]``.
"""

from __future__ import annotations

import time

import mlx.core as mx

from bench.common import base_parser, load, median_ms, print_table
from bench.bench_forward_split import _Rows, back_to_the_step, cpu_backend, filled_rows

from engine.runtime.runner.backends.cpu import host_forward

WIDTHS = (1, 2, 4, 8, 9, 12, 16)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1000, help="tokens cached per agent (default 1000)")
    parser.add_argument("--repeats", type=int, default=9, help="timed passes per cell (median)")
    args = parser.parse_args()
    loaded = load(args)
    model = loaded.model
    backend = cpu_backend()
    backend.attach(model)
    time.sleep(15)  # the compiled loops load in the background
    rows_out = []
    for batch in (1, 8):
        rows = [_Rows(layers) for layers in filled_rows(loaded, batch, args.context, backend.kinds)]
        for row in rows:
            for layer in row.layers:
                layer.reserve(args.context + max(WIDTHS) + 8)
        for width in WIDTHS:
            def host(width=width) -> None:
                back_to_the_step([r.layers for r in rows], args.context)
                flat = mx.array([5] * (width * batch), dtype=mx.uint32)
                mx.eval(host_forward.decode(model, flat, rows, backend._tables, backend._workers, backend._linear_ok,
                                            [width] * batch).argmax(-1))

            def through_mlx(width=width) -> None:
                back_to_the_step([r.layers for r in rows], args.context)
                caches = rows[0].layers if batch == 1 else [
                    backend.ragged([rows[b].layers[i] for b in range(batch)]) for i in range(len(model.layers))]
                mx.eval(backend.forward(model, mx.array([[5] * width] * batch), caches).argmax(-1))

            cells = [batch, width, median_ms(host, args.repeats) if host_forward.supports(model) else float("nan"),
                     median_ms(through_mlx, args.repeats)]
            rows_out.append(cells)
            print(f"# {batch} agents, width {width}: host {cells[2]:.1f} ms, MLX forward {cells[3]:.1f} ms", flush=True)
    print_table(["agents", "tokens per agent", "host path ms", "MLX forward ms"], rows_out)


if __name__ == "__main__":
    main()
