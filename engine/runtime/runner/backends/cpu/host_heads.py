"""Latent attention's per-head projections on the CPU: each head's weights read once for the whole batch.

mlx-lm's absorbed latent attention (DeepSeek V3, GLM-4.7-Flash, Kimi,
Mistral 4) projects queries into the latent space and attention's output out
of it with one matrix per head (``mla.MultiLinear``: ``x @ weight[h].T``),
written as a product that broadcasts the batch over the heads. MLX's CPU
matmul runs that as rows x heads separate products, reading each head's
matrix once per row: at 16 agents of a DeepSeek V3-shaped model (8 heads,
128 x 512 each) ``embed_q`` took 3.1 ms a layer and ``unembed_out`` 3.2 ms,
more than the rest of the layer's projections together. Folding the rows
into each head's product (heads, rows x tokens, width) makes it one
matrix product per head: 0.26 and 0.28 ms, the same sums
(bench_model_families' DeepSeek V3 shape, the 2-core x86 box).

On Metal and CUDA the broadcast product is one kernel that keeps the
weights in cache, so this stays with the CPU backend, which gives the
model's projections this class while it is attached (a class swap, as
``host_linear`` does for linear layers, and for the same reason).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear


def folded(x: mx.array, product: Any) -> mx.array:
    """``product(x)`` for ``x`` (rows, heads or 1, tokens, width) with the rows folded into the tokens axis:
    ``product`` then sees (heads or 1, rows x tokens, width) and returns (heads, rows x tokens, out)."""
    rows, heads, tokens, width = x.shape
    out = product(x.transpose(1, 0, 2, 3).reshape(heads, rows * tokens, width))
    return out.reshape(out.shape[0], rows, tokens, out.shape[-1]).transpose(1, 0, 2, 3)


def _folds(x: mx.array) -> bool:
    return x.ndim == 4 and x.shape[0] > 1


class FoldedMultiLinear(MultiLinear):
    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        if not _folds(x):
            return super().__call__(x, transpose)
        weight = self.weight.swapaxes(-1, -2) if transpose else self.weight
        return folded(x, lambda rows: rows @ weight)


class FoldedQuantizedMultiLinear(QuantizedMultiLinear):
    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        if not _folds(x):
            return super().__call__(x, transpose)
        return folded(x, lambda rows: super(FoldedQuantizedMultiLinear, self).__call__(rows, transpose))


_FOLDED = {MultiLinear: FoldedMultiLinear, QuantizedMultiLinear: FoldedQuantizedMultiLinear}
_PLAIN = {folded_class: plain for plain, folded_class in _FOLDED.items()}


def swap_in(model: Any) -> int:
    """Give the model's per-head projections the folded classes (exact classes only); returns how many."""
    swapped = 0
    for _, module in model.named_modules():
        cls = _FOLDED.get(type(module))
        if cls is not None:
            module.__class__ = cls
            swapped += 1
    return swapped


def swap_out(model: Any) -> None:
    """Give them mlx-lm's classes back."""
    for _, module in model.named_modules():
        cls = _PLAIN.get(type(module))
        if cls is not None:
            module.__class__ = cls
