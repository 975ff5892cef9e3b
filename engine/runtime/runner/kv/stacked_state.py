"""One recurrent layer of a batch: the rows' states stacked along the batch axis, as the model reads them.

A batched forward pass reads ``cache[i]`` as one array of all rows and writes
it back whole. The view stacks the rows' arrays when the model reads slot
``i`` and hands each row its own slice of what the model writes, so every
row's state stays its own (and snapshots of it stay valid). A row without a
state yet (its first token) reads zeros, as mlx-lm's ``ArraysCache.merge``
gives it.

The copy this costs is one state per row and layer each pass, the price of
letting rows join and leave the batch freely; next to a forward pass that
reads every weight it is small on the CPU and negligible on a GPU.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from engine.runtime.runner.kv.recurrent_state import RecurrentState


class StackedStates(ArraysCache):
    """Row ``b`` of the batch is ``rows[b]``'s state (an ``ArraysCache`` to model code that asks)."""

    def __init__(self, rows: Sequence[RecurrentState]) -> None:  # (not ArraysCache's)
        self.lengths = None
        self.left_padding = None
        self.rows = list(rows)
        self._zeros: list[tuple[mx.array, ...] | None] = [None] * len(self.rows)

    def __getitem__(self, index: int) -> mx.array | None:
        parts = [row[index] for row in self.rows]
        if all(p is None for p in parts):
            return None
        return mx.concatenate([p if p is not None else self._zero(b, index) for b, p in enumerate(parts)], axis=0)

    def __setitem__(self, index: int, value: mx.array) -> None:
        for b, row in enumerate(self.rows):
            row[index] = value[b:b + 1]

    def _zero(self, b: int, index: int) -> mx.array:
        if self._zeros[b] is None:
            self._zeros[b] = self.rows[b].zeros()
        return self._zeros[b][index]  # type: ignore[index]

    def advance(self, n: int) -> None:
        """(The model's call; the batch moves each row's position.)"""

    def make_mask(self, n: int, **kwargs: Any) -> None:
        return None

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)
