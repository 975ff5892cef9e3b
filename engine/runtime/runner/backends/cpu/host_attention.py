"""The CPU backend's caches' attention (``kv/attention.py``): which arithmetic each call takes.

* A long prefill chunk (more than one query, over ``cpu_math.MAX_SCORES``
  scores): ``host_softmax.attention``, its softmax in compiled rows, once
  that kernel has loaded.
* Until then (and where it cannot load): ``cpu_math.attention`` in blocks of
  queries, each block evaluated before the next is built, or left in the
  model's graph (``evaluate_blocks``, below).
* Anything shorter: ``cpu_math.attention`` (its faster ``exp`` above
  ``MIN_ELEMENTS`` scores, MLX's fused kernel below).
* Attention sinks (gpt-oss): MLX's fused kernel.

A softmax over joined segment scores (shared prefixes, ``kv/segment.py``)
takes the compiled rows past ``MAX_SCORES``, ``cpu_math.softmax`` below it
(above ``MIN_ELEMENTS``).

``evaluate_blocks`` (the fallback only): measured on 466-token chunks,
the 2-core CPU box (whole forward passes, blocks evaluated / left in
the graph / MLX's fused attention):

* SmolLM2 (9 heads of 64) over 4K keys: 6.3 / 8.6 / 11.3 s. Evaluating
  each block keeps its scores in the CPU's caches, as designed.
* The Qwen3.5-0.8B-shaped hybrid (8 heads of 256, 2 attention layers of 8)
  over 20K keys: 8.1 / 6.6 / 6.5 s with mlx-lm's recurrent steps in the
  graph, 4.1 / 3.0 / 2.8 s with the compiled recurrence
  (``host_gated_delta.py``). Here even the smallest block (8 queries x 8
  heads x 20K keys, 5 MB of scores) is past the caches, so an evaluation
  per block buys nothing and stops the pass ~60 times a layer.
* Gemma 3 270M (4 heads of 256) over 4K / 16K keys: 1.50 / 1.59 s and
  2.73 / 2.62 s: no difference worth a rule.

The backend leaves the blocks in the graph for models with recurrent layers
(``CpuBackend.kinds_for``), the only shape where it was measured to pay.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.runtime.runner.backends.cpu import cpu_math, host_softmax
from engine.runtime.runner.backends.cpu.host_softmax import ROW_SOFTMAX


class HostAttention:
    __slots__ = ("evaluate_blocks",)

    def __init__(self, evaluate_blocks: bool = True) -> None:
        self.evaluate_blocks = evaluate_blocks

    def sdpa(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
             sinks: Any = None) -> mx.array:
        if sinks is not None:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        batch, q_heads, n, _ = queries.shape
        if n > 1 and batch * q_heads * n * keys.shape[2] > cpu_math.MAX_SCORES and ROW_SOFTMAX.ready:
            return host_softmax.attention(queries, keys, values, scale, mask, cpu_math.softmax)
        return cpu_math.attention(queries, keys, values, scale, mask, self.evaluate_blocks)

    def softmax(self, scores: mx.array) -> mx.array:
        if cpu_math.MIN_ELEMENTS <= scores.size <= cpu_math.MAX_SCORES:
            return cpu_math.softmax(scores)
        if scores.size > cpu_math.MAX_SCORES and ROW_SOFTMAX.ready:
            weights = scores.astype(mx.float32) if scores.dtype != mx.float32 else scores
            if ROW_SOFTMAX.in_place(weights):
                return weights.astype(scores.dtype)
        return mx.softmax(scores, axis=-1, precise=True)


HOST_ATTENTION = HostAttention()
# For the attention layers of a model with recurrent layers too (hybrids): see the module's docstring.
HOST_ATTENTION_IN_GRAPH = HostAttention(evaluate_blocks=False)
