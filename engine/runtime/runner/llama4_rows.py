"""Llama 4 in a batch: each row's chunk mask and query scale from its own positions.

Two things in Llama 4's code read one sequence's position as a number, where a
batch's rows each stand at their own:

* its text model builds the mask of its chunked layers once a pass from the
  first layer's cache (``start_position`` and ``offset``), before any layer
  runs;
* its global layers (no rotary embedding) scale their queries by position
  (``attn_temperature_tuning``), from ``mx.arange(offset + 1, ...)``.

While the engine has the model, its text model and attention modules take
subclasses that, in a batch's pass (the caches are ``RaggedLayerCache``
views), ask the first chunked layer for every row's own chunk mask
(``ChunkedKV.make_mask``: the mask the model builds for that row alone) and
scale each row's queries at its own positions; a single sequence's pass is
mlx-lm's code unchanged.

Why class swaps: both are computed inside the model's ``__call__`` with no
seam to hand them per-row positions; only the objects' classes can route
them for this one model (as ``ragged.py``'s hook does for attention). The
engine swaps them back when it detaches the model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import llama4
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.llama4 import Attention, LlamaModel

from engine.runtime.runner.kv.ragged import RaggedLayerCache


class RowChunkedLlamaModel(LlamaModel):
    """Llama 4's text model whose batch passes mask each row by its own chunk."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if cache is None or not isinstance(cache[0], RaggedLayerCache):
            return super().__call__(inputs, cache)
        h = self.embed_tokens(inputs)
        for idx, c in enumerate(cache):
            if _chunked(idx):
                c.maybe_trim_front()
        chunk_mask = cache[0].make_mask(h.shape[1])
        global_mask = create_attention_mask(h, cache[3])
        for idx, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, chunk_mask if _chunked(idx) else global_mask, cache=c)
        return self.norm(h)


class RowScaledAttention(Attention):
    """Llama 4's attention whose global layers scale a batch's queries at each row's own positions."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not (isinstance(cache, RaggedLayerCache) and self.attn_temperature_tuning and not self.use_rope):
            return super().__call__(x, mask, cache)
        # mlx-lm's Attention.__call__ for a layer without rotary embedding (so without its query/key norm),
        # the scale per row: (rows, 1, tokens, 1) where mlx-lm's is (tokens, 1).
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        positions = cache.offset[:, None] + mx.arange(1, L + 1)[None, :]
        attn_scales = mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0
        queries = (queries * attn_scales[:, None, :, None]).astype(queries.dtype)
        keys, values = cache.update_and_fetch(keys, values)
        output = llama4.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _chunked(idx: int) -> bool:
    # Llama 4's pattern (its LlamaModel): three chunked layers, then a global one.
    return (idx + 1) % 4 != 0


_SWAPS = {LlamaModel: RowChunkedLlamaModel, Attention: RowScaledAttention}


def install(model: Any) -> bool:
    """Give a Llama 4 model's text model and attention modules the row-aware classes; False where it has none."""
    swapped = False
    for _, module in model.named_modules():
        row_class = _SWAPS.get(type(module))
        if row_class is not None:
            module.__class__ = row_class
            swapped = True
    return swapped


def uninstall(model: Any) -> None:
    """Give them mlx-lm's classes back."""
    plain = {row_class: cls for cls, row_class in _SWAPS.items()}
    for _, module in model.named_modules():
        cls = plain.get(type(module))
        if cls is not None:
            module.__class__ = cls
