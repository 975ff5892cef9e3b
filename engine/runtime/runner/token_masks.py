"""Ruled rows' masks on a step's logits: disallowed tokens at -inf before sampling.

A row's next token is ruled by its output format (a constraint's bitmask
over the tokenizer's vocabulary, ``TokenConstraint.allowed``; a few more
tokens may be let in beside it: the marker that opens a reasoning) or by its
reasoning (a spent budget forces the end marker: one token only; or keeps
a few tokens out). The model's logits may be wider than the tokenizer's
vocabulary (padded embedding tables): tokens past a bitmask are never
allowed. Masking before sampling keeps every sampler unchanged: greedy takes
the best allowed token, sampled rows filter (top-k, top-p) and draw among
allowed ones only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Rows

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, slots=True)
class Allow:
    """The tokens a bitmask allows (token ``t`` at bit ``t % 32`` of 32-bit word ``t // 32``), and ``also`` these."""

    words: np.ndarray
    also: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Only:
    token: int


@dataclass(frozen=True, slots=True)
class Without:
    tokens: tuple[int, ...]


RowMask = Allow | Only | Without


def allowed_rows(width: int, rows: int, masks: Rows[tuple[int, RowMask]]) -> np.ndarray:
    """A [rows, width] boolean array: True everywhere but in the masked rows, where each mask says."""
    allow = np.ones((rows, width), dtype=bool)
    for row, mask in masks:
        if isinstance(mask, Only):
            allow[row, :] = False
            allow[row, mask.token] = True
        elif isinstance(mask, Without):
            allow[row, list(mask.tokens)] = False
        else:
            bits = np.unpackbits(mask.words.view(np.uint8), bitorder="little")[:width]
            allow[row, :len(bits)] = bits.astype(bool)
            allow[row, len(bits):] = False
            allow[row, [t for t in mask.also if t < width]] = True
    return allow


def masked(logits: mx.array, masks: Rows[tuple[int, RowMask]]) -> mx.array:
    """``logits`` [rows, vocabulary] with each ``(row, mask)``'s disallowed tokens at -inf."""
    if not masks:
        return logits
    allow = allowed_rows(logits.shape[-1], logits.shape[0], masks)
    return mx.where(mx.array(allow), logits, mx.array(-mx.inf, dtype=logits.dtype))
