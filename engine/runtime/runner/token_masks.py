"""Constrained rows' masks on a step's logits: disallowed tokens at -inf before sampling.

A constraint's mask is a bitmask over the tokenizer's vocabulary
(``TokenConstraint.allowed``); the model's logits may be wider (padded
embedding tables): tokens past the tokenizer's are never allowed. Masking
before sampling keeps every sampler unchanged: greedy takes the best allowed
token, sampled rows filter (top-k, top-p) and draw among allowed ones only.
"""

from __future__ import annotations

from typing import Sequence as Rows

import mlx.core as mx
import numpy as np


def allowed_rows(width: int, rows: int, masks: Rows[tuple[int, np.ndarray]]) -> np.ndarray:
    """A [rows, width] boolean array: True everywhere but in the masked rows, where the bitmask says."""
    allow = np.ones((rows, width), dtype=bool)
    for row, words in masks:
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:width]
        allow[row, :len(bits)] = bits.astype(bool)
        allow[row, len(bits):] = False
    return allow


def masked(logits: mx.array, masks: Rows[tuple[int, np.ndarray]]) -> mx.array:
    """``logits`` [rows, vocabulary] with each ``(row, bitmask)``'s disallowed tokens at -inf."""
    if not masks:
        return logits
    allow = allowed_rows(logits.shape[-1], logits.shape[0], masks)
    return mx.where(mx.array(allow), logits, mx.array(-mx.inf, dtype=logits.dtype))
