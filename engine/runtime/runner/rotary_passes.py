"""The rotary positions of a forward pass's rows, for a model whose positions part from its cache's (M-RoPE).

Every forward pass of the engine goes through its backend's ``forward`` with the pass's caches: one
sequence's layer caches, or a batch's views of each row's (``kv/ragged.py``). A sequence whose prompt holds
images of a multi-axis model carries its rotary positions (domain/rotary_positions.py) on its first layer's
cache for the turn (:func:`assign`); :func:`positioned` reads each row's there, with the row's cache offset,
and tells the model's rotary slot (models/multimodal_rope.py) how the pass rotates. Keyed by the caches
themselves, so a backend that splits a batch into several passes (rows of one width at a time, one row a
pass) rotates each pass right with no word from the batch.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, Sequence

import mlx.core as mx
import numpy as np

from engine.domain.rotary_positions import ImagePositions
from engine.models.multimodal_rope import RotaryPass, slot_of

_ATTRIBUTE = "rotary_positions"


def assign(kv: Any, positions: ImagePositions | None) -> None:
    """The rotary positions of ``kv``'s tokens for the turn running on it (None: its cache positions)."""
    if positions is not None or getattr(kv.layers[0], _ATTRIBUTE, None) is not None:
        setattr(kv.layers[0], _ATTRIBUTE, positions)


def positioned(model: Any, cache: Any, tokens: int) -> ContextManager[None]:
    """A forward pass of ``tokens`` tokens a row over ``cache`` (what the model is called with), rotating each
    row at its rotary positions."""
    slot = slot_of(model)
    if slot is None:
        return nullcontext()
    first = cache[0]
    rows = list(getattr(first, "rows", [first]))
    positions = [getattr(row, _ATTRIBUTE, None) for row in rows]
    if all(p is None for p in positions):
        return nullcontext()
    return slot.rotating(_pass(positions, [int(row.offset) for row in rows], tokens))


def _pass(positions: Sequence[ImagePositions | None], offsets: Sequence[int], tokens: int) -> RotaryPass | None:
    if any(p is not None and p.in_image(start, tokens) for p, start in zip(positions, offsets)):
        axes = np.stack([np.array(p.axes(start, tokens)) if p is not None
                         else np.tile(np.arange(start, start + tokens), (3, 1)) for p, start in zip(positions, offsets)],
                        axis=1)
        return RotaryPass(axes=mx.array(axes))
    shifts = [p.shift(start) if p is not None else 0 for p, start in zip(positions, offsets)]
    if not any(shifts):
        return None
    return RotaryPass(shifts=mx.array(shifts, dtype=mx.int32))
