"""Inside the decode forward pass on this machine: weights, attention layout and MLX's elementwise ops.

bench_step_profile shows that the model's forward pass is >90% of a decode
step for both engines. This splits the forward itself, on the same model, at
batch 1 and 16 with every row holding ``--context`` tokens:

- the whole decode forward with mlx-lm's batched ``KVCache`` (one cache for
  all rows: what a padded batch costs), and with the engine's ragged rows
  (each row its own resident cache, attention per row: ``kv/ragged.py``), through
  the MLX backend (``backends/mlx.py``);
- the same ragged forward through the CPU backend (``backends/cpu/``) without
  its linear pass: ``cpu_math``'s softmax and SiLU instead of MLX's
  per-element ``exp``, and decode attention in compiled loops;
- the model's linear layers alone (its own weight matrices, the same
  activations' shapes): the floor a forward cannot go under without reading
  fewer weight bytes or doing less arithmetic;
- where the engine's ragged forward goes at batch 16: the same forward with
  the step's keys and values written through MLX slice updates instead of in
  place by the compiled loops; with each row's attention in MLX instead of
  compiled loops (``host_decode.py``); with attention left out (each
  layer's queries passed on, the step's positions written through MLX);
  then with the cache writes left out too; and with the rows' keys and
  values gathered into one batch for a single attention call per layer
  (what a padded batch layout would cost, the gather's copy included);
- the engine's decode step as it runs now, through the CPU backend with every
  host path on: a Llama-family model's whole step on the host
  (``host_forward.py``: numpy, the compiled linear pass up to 8 rows,
  host_decode's attention loops), and for other models the ragged forward
  with the linear pass in their linear layers (``host_linear.py``); the
  "fast CPU math" column above is the engine before them;
- memory read bandwidth (numpy summing 256 MB), which bounds the batch-1 weight read;
- MLX's elementwise transcendental ops (exp, sigmoid, sin) against numpy's on
  the same data: the activations, rotary embeddings and softmax use them.

Run: ``LD_PRELOAD=... python -m bench.bench_forward_split [--model M] [--context N] [--json PATH]``.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from bench.common import base_parser, load, median_ms, print_table
from bench.results import BenchResult, recorded

from engine.runtime.runner.backends.mlx import MlxBackend
from engine.runtime.runner.kv.full_kv import FullKV
from engine.runtime.runner.kv.sequence_kv import kv_shape

BATCHES = (1, 16)


def linear_layers(model) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]


def linears_only(model, batch: int) -> Callable[[], None]:
    """Every linear layer once, on a batch of one-token activations of its input width."""
    layers = linear_layers(model)
    inputs = {}
    for layer in layers:
        width = layer.weight.shape[1] * (32 // layer.bits if isinstance(layer, nn.QuantizedLinear) else 1)
        inputs.setdefault(width, mx.random.normal((batch, 1, width)))
    mx.eval(list(inputs.values()))
    head = model.language_model if hasattr(model, "language_model") else model
    embed = getattr(getattr(head, "model", head), "embed_tokens", None)
    tied = embed is not None and not any(name.endswith("lm_head") for name, _ in model.named_modules())

    def run() -> None:
        outs = []
        for layer in layers:
            width = layer.weight.shape[1] * (32 // layer.bits if isinstance(layer, nn.QuantizedLinear) else 1)
            outs.append(layer(inputs[width]))
        if tied:  # the output head is the embedding matrix, used as a linear layer
            outs.append(embed.as_linear(inputs[embed.weight.shape[1]] if embed.weight.shape[1] in inputs
                                        else mx.random.normal((batch, 1, embed.weight.shape[1]))))
        mx.eval(outs)
    return run


def batched_forward(model, n_layers: int, batch: int, context: int) -> Callable[[], None]:
    cache = [KVCache() for _ in range(n_layers)]
    model(mx.array([[1 + i % 1000 for i in range(context)]] * batch), cache=cache)
    mx.eval([c.keys for c in cache])
    token = mx.array([[5]] * batch)

    def run() -> None:
        for c in cache:  # every timed step attends over the same context length
            c.offset = context
        mx.eval(model(token, cache=cache)[:, -1, :].argmax(-1))
    return run


def filled_rows(loaded, batch: int, context: int, kinds) -> list[list[FullKV]]:
    """``batch`` rows of a backend's per-layer caches (``kinds``), each prefilled with ``context`` tokens."""
    shape = kv_shape(loaded.spec.geometry)
    rows = []
    for _ in range(batch):
        layers = [kinds.full(shape, loaded.spec.block_tokens) for _ in range(len(loaded.model.layers))]
        for layer in layers:
            layer.reserve(context + 8)
        loaded.model(mx.array([[1 + i % 1000 for i in range(context)]]), cache=layers)
        mx.eval([layer.keys for layer in layers])
        rows.append(layers)
    return rows


def back_to_the_step(rows: list[list[FullKV]], context: int) -> None:
    """Every row at the same decode step again. In the engine a decode step writes a position never written
    before, which the CPU backend's loops write in place (HostFullKV.claim_one); a position rewritten after a
    rewind goes through MLX. Each timed step here is the engine's kind."""
    for layers in rows:
        for layer in layers:
            layer.offset = context
            if hasattr(layer, "_untouched_from"):
                layer._untouched_from = context


def ragged_forward(loaded, batch: int, context: int, backend: MlxBackend) -> Callable[[], None]:
    """The decode forward as the engine's batch runs it on ``backend``: one row on its own caches, several
    through the backend's view of each layer."""
    model = loaded.model
    backend.attach(model)
    n_layers = len(model.layers)
    rows = filled_rows(loaded, batch, context, backend.kinds)
    token = mx.array([[5]] * batch)

    def run() -> None:
        back_to_the_step(rows, context)
        caches = rows[0] if batch == 1 else [backend.ragged([rows[b][i] for b in range(batch)]) for i in range(n_layers)]
        mx.eval(backend.forward(model, token, caches)[:, -1, :].argmax(-1))
    return run


class _Rows:
    """What a backend's decode reads of a sequence's cache: its layers."""

    def __init__(self, layers: list[FullKV]) -> None:
        self.layers = layers


def engine_step(loaded, batch: int, context: int, backend) -> tuple[str, Callable[[], None]]:
    """The engine's decode step now, on the CPU backend with every host path: on the host for a Llama, else the
    ragged forward with the linear pass."""
    model = loaded.model
    backend.attach(model)
    rows = [_Rows(layers) for layers in filled_rows(loaded, batch, context, backend.kinds)]
    if not backend.steps_on_host(model, rows):
        return "ragged rows, fast CPU math, linear pass", ragged_forward(loaded, batch, context, backend)
    token = mx.array([5] * batch)

    def run() -> None:
        back_to_the_step([row.layers for row in rows], context)
        mx.eval(backend.decode(model, token, rows).argmax(-1))
    return "whole step on the host (host_forward)", run


def ablated_backends() -> dict[str, Any]:
    """Label -> a CPU backend (decode loops on, no linear pass) whose batch view has parts left out or batched
    (every row holds the same context, so no masks)."""
    from engine.runtime.runner.backends.cpu import cpu_math
    from engine.runtime.runner.backends.cpu.backend import CpuBackend, CpuOptions
    from engine.runtime.runner.backends.cpu.host_kv import HostRaggedLayerCache

    class Gathered(HostRaggedLayerCache):
        def attend(self, queries, scale, mask, sinks=None):
            self.write_claimed_through_mlx()
            keys = mx.concatenate([row.keys[..., :n, :] for row, n in zip(self.rows, self._held)], axis=0)
            values = mx.concatenate([row.values[..., :n, :] for row, n in zip(self.rows, self._held)], axis=0)
            return cpu_math.attention(queries, keys, values, scale, None)

    class MlxAttend(HostRaggedLayerCache):
        def attend(self, queries, scale, mask, sinks=None):
            self._loops = lambda: False  # claimed positions are written through MLX, rows attend in MLX
            return super().attend(queries, scale, mask, sinks)

    class NoAttend(HostRaggedLayerCache):
        """Attention left out; the step's positions still written (through MLX, as without the loops' writes)."""

        def attend(self, queries, scale, mask, sinks=None):
            self.write_claimed_through_mlx()
            return queries

    class WritesThroughMlx(HostRaggedLayerCache):
        """The step's positions written through MLX slice updates (the path without the in-place loops)."""

        def _decode_positions(self, keys, values):
            self._held = [row.append_one(keys[b:b + 1], values[b:b + 1]) for b, row in enumerate(self.rows)]
            self._new, self._claimed = None, []

    class NoWrites(NoAttend):
        def update_and_fetch(self, keys, values):
            return keys, values

    def backend(view: type | None) -> CpuBackend:
        class Ablated(CpuBackend):
            def ragged(self, layers):
                return view(layers, self.loops_ready, self._workers)

        return (CpuBackend if view is None else Ablated)(CpuOptions(linear_pass=False, host_step=False))

    return {
        "engine (fast CPU math, decode attention in compiled loops)": backend(None),
        "positions written through MLX slice updates, not in place": backend(WritesThroughMlx),
        "attention per row in MLX (compiled loops off)": backend(MlxAttend),
        "rows gathered, one attention per layer": backend(Gathered),
        "attention left out": backend(NoAttend),
        "attention and cache writes left out": backend(NoWrites),
    }


def ablations(loaded, context: int, repeats: int) -> list[list[object]]:
    """The engine's batch-16 ragged forward with parts left out or batched, on the CPU backend."""
    rows = []
    for label, backend in ablated_backends().items():
        rows.append([label, median_ms(ragged_forward(loaded, 16, context, backend), repeats)])
        backend.detach(loaded.model)
        backend.close()
    base = rows[0][1]
    return [[label, ms, base - ms] for label, ms in rows]


def elementwise(repeats: int) -> list[list[object]]:
    data = np.random.default_rng(0).normal(size=(16, 1536)).astype(np.float32)
    x = mx.array(data)
    mx.eval(x)
    ops = {
        "exp": (mx.exp, np.exp),
        "sigmoid": (mx.sigmoid, lambda a: 1 / (1 + np.exp(-a))),
        "sin": (mx.sin, np.sin),
        "multiply (for scale)": (lambda a: a * a, lambda a: a * a),
    }
    rows = []
    for name, (ours, theirs) in ops.items():
        mlx_ns = median_ms(lambda: mx.eval(ours(x)), repeats) * 1e6 / data.size
        numpy_ns = median_ms(lambda: theirs(data), repeats) * 1e6 / data.size
        rows.append([name, mlx_ns, numpy_ns, mlx_ns / numpy_ns])
    return rows


def cpu_backend(**options: bool) -> Any:
    from engine.runtime.runner.backends.cpu.backend import CpuBackend, CpuOptions

    return CpuBackend(CpuOptions(**options))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=200, help="tokens each row's cache holds (default 200)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per cell (default 10)")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    result = BenchResult("bench_forward_split", "Inside the decode forward pass",
                         {"model": args.model, "context": args.context, "repeats": repeats})
    with recorded(result, args.json):
        loaded = load(args)
        model = loaded.model
        n_layers = len(model.layers)
        weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        big = np.ones(64 * 2**20, dtype=np.float32)
        read_gbs = big.nbytes / (median_ms(lambda: big.sum(), repeats) / 1000) / 1e9
        result.metric("machine", "memory read bandwidth (numpy sum of 256 MB)", read_gbs, "GB/s", better="higher")
        result.metric("machine", "model weight bytes", weight_bytes / 1e6, "MB", better="neither")
        print(f"# weights {weight_bytes / 1e6:.0f} MB; memory read {read_gbs:.1f} GB/s, so reading them once "
              f"takes {weight_bytes / read_gbs / 1e6:.1f} ms")
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        rows = []
        for batch in BATCHES:
            linear = median_ms(linears_only(model, batch), repeats)
            whole = median_ms(batched_forward(model, n_layers, batch, args.context), repeats)
            # MLX's own attention and SiLU, as mlx_lm.server runs them.
            per_row = median_ms(ragged_forward(loaded, batch, args.context, MlxBackend()), repeats)
            fast = None
            if on_cpu:
                fast_backend = cpu_backend(linear_pass=False, host_step=False)
                fast = median_ms(ragged_forward(loaded, batch, args.context, fast_backend), repeats)
                fast_backend.detach(model)
                fast_backend.close()
                result.metric(f"decode forward at batch {batch}, {args.context}-token context (ms)",
                              "whole forward, ragged rows, fast CPU math (the engine)", fast, "ms", better="lower")
            rows.append([batch, linear, whole, per_row, fast, whole - linear, per_row - whole])
            group = f"decode forward at batch {batch}, {args.context}-token context (ms)"
            result.metric(group, "linear layers alone", linear, "ms", better="lower")
            result.metric(group, "whole forward, batched KVCache", whole, "ms", better="lower")
            result.metric(group, "whole forward, ragged rows, MLX's math", per_row, "ms", better="lower")
        print(f"\n## Decode forward, {args.context}-token context per row (median ms)")
        print_table(["batch", "linear layers alone", "forward, batched cache", "forward, ragged rows",
                     "ragged rows, fast CPU math", "batched - linear", "ragged - batched"], rows)
        if on_cpu:
            parts = ablations(loaded, args.context, repeats)
            for label, ms, _ in parts:
                result.metric(f"batch-16 ragged forward, {args.context}-token context (ms)", label, ms, "ms",
                              better="lower")
            print(f"\n## Where the engine's batch-16 forward goes, {args.context}-token context (median ms)")
            print_table(["forward", "ms", "engine - this"], parts)
        if on_cpu:
            now = []
            for batch in BATCHES:
                backend = cpu_backend()
                label, run = engine_step(loaded, batch, args.context, backend)
                ms = median_ms(run, repeats)
                backend.detach(model)
                backend.close()
                result.metric(f"decode forward at batch {batch}, {args.context}-token context (ms)",
                              f"the engine's step now: {label}", ms, "ms", better="lower")
                now.append([batch, label, ms])
            print(f"\n## The engine's decode forward now, {args.context}-token context (median ms)")
            print_table(["batch", "path", "ms"], now)
        ops = elementwise(repeats)
        for name, mlx_ns, numpy_ns, ratio in ops:
            result.metric("elementwise ns per element (16 x 1536 float32)", f"{name}: MLX", mlx_ns, "ns", better="lower")
            result.metric("elementwise ns per element (16 x 1536 float32)", f"{name}: numpy", numpy_ns, "ns",
                          better="lower")
        print("\n## Elementwise ops, ns per element (16 x 1536 float32)")
        print_table(["op", "MLX", "numpy", "MLX / numpy"], ops)


if __name__ == "__main__":
    main()
