"""A recurrent layer's state of one sequence (linear attention, Mamba, RWKV), as mlx-lm's model code reads it.

mlx-lm's recurrent layers keep their state in an ``ArraysCache``: a few
arrays the layer reads at ``cache[i]`` and replaces after every forward pass
(a convolution window, a recurrent matrix), the same size whatever the
sequence's length. This class offers the model that interface for one
sequence, and the engine what it needs around it: the position the state
stands at, and snapshots.

A state cannot be cut back: it resumes only where a snapshot was kept
(:class:`StateSnapshot`). MLX arrays are values and a forward pass replaces
the state's arrays instead of writing into them, so a snapshot is a
reference, free when taken; the pool counts it from then on, since the next
pass leaves it the only holder of those arrays.

The model never says how many tokens went through: ``ArraysCache.advance``
only moves batch padding bookkeeping, and not every family calls it. The
batch that runs the forward pass moves ``offset`` (:meth:`advanced`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from engine.domain.cache_spec import StateGeometry

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """A recurrent layer at ``offset`` tokens (``arrays`` None: before any token)."""

    offset: int
    arrays: tuple[mx.array, ...] | None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays) if self.arrays is not None else 0


class RecurrentState(ArraysCache):
    """One sequence's state of one recurrent layer, indexable as mlx-lm's ``ArraysCache``.

    A subclass, because model code asks: Mamba writes its new state back only
    into an ``isinstance(cache, ArraysCache)``. Every method the model calls is
    this class's own.
    """

    # No K/V: code that walks layers for K/V arrays skips this one (its arrays are :attr:`arrays`).
    keys = None
    values = None

    def __init__(self, geometry: StateGeometry) -> None:  # (not ArraysCache's: no batch bookkeeping)
        self.geometry = geometry
        self.cache: list[mx.array | None] = [None] * len(geometry.arrays)
        self.offset = 0
        # Room was reserved for a first token (the pool pays for the state from then on).
        self.reserved = False
        # ArraysCache's batch bookkeeping: a sequence of its own has no padding and no per-row lengths.
        self.lengths = None
        self.left_padding = None

    # -- what the model reads ---------------------------------------------------------
    def __getitem__(self, index: int) -> mx.array | None:
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.cache[index] = value

    def advance(self, n: int) -> None:
        """(The model's call: nothing to move without padding. See :meth:`advanced`.)"""

    def make_mask(self, n: int, **kwargs: Any) -> None:
        return None  # no padding to hide from the recurrence

    def empty(self) -> bool:
        return self.cache[0] is None

    @property
    def state(self) -> list[mx.array | None]:
        return self.cache

    # -- the engine's side ------------------------------------------------------------
    def advanced(self, n: int) -> None:
        """``n`` more tokens went through the layer."""
        self.offset += n

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def state_now(self) -> StateSnapshot:
        held = tuple(self.cache) if self.cache[0] is not None else None
        return StateSnapshot(self.offset, held)  # type: ignore[arg-type]

    def restore(self, snapshot: StateSnapshot) -> None:
        self.offset = snapshot.offset
        self.cache = list(snapshot.arrays) if snapshot.arrays is not None else [None] * len(self.geometry.arrays)
        self.reserved = snapshot.arrays is not None

    def can_continue_from(self, n_tokens: int) -> bool:
        return n_tokens == self.offset

    def trim_to(self, n_tokens: int) -> None:
        if n_tokens != self.offset:
            raise ValueError(f"a recurrent state at {self.offset} tokens cannot go back to {n_tokens}")

    def reset(self) -> None:
        self.offset = 0
        self.cache = [None] * len(self.geometry.arrays)
        self.reserved = False

    def blank(self) -> "RecurrentState":
        return type(self)(self.geometry)

    def load(self, offset: int, arrays: tuple[mx.array, ...]) -> None:
        """Become a state read back from elsewhere (a file, a donor) at ``offset`` tokens."""
        if len(arrays) != len(self.geometry.arrays):
            raise ValueError(f"a state of {len(self.geometry.arrays)} arrays, got {len(arrays)}")
        self.offset, self.cache, self.reserved = offset, list(arrays), True

    def zeros(self) -> tuple[mx.array, ...]:
        """A state of zeros of this layer's shapes (a batch row that has none yet)."""
        return tuple(mx.zeros((1, *shape), dtype=_DTYPES[dtype]) for shape, dtype in self.geometry.arrays)

    # -- capacity (a state is all or nothing) ---------------------------------------------
    def capacity_for(self, n_tokens: int) -> int:
        return 1 if n_tokens > 0 else 0

    @property
    def capacity(self) -> int:
        return 1 if self.reserved or self.offset > 0 or self.cache[0] is not None else 0

    def reserve(self, n_tokens: int) -> int:
        self.reserved = self.reserved or n_tokens > 0  # the model creates the arrays
        return 0

    def shrink(self) -> int:
        return 0
