"""A run of positions of one layer group's K/V, as MLX arrays: what a cache hands the disk tier and gets back.

The runtime cuts a resident cache into slices on block boundaries
(``SequenceKV.slices``); the store writes them (``cache_file.PersistedBlock``
is the same run as the file holds it) and reads them back as slices for the
runtime to install.

A recurrent layer group (linear attention, Mamba, RWKV) holds no positions:
its slice is the group's state at one token position (``start``, ``length``
0), each layer's arrays in ``states``, and no K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class LayerSlice:
    """Positions ``[start, start + length)`` of every layer of one group; ``checkpoint``: None for the cache's
    own positions, ``i`` for a run of its ``i``-th window checkpoint (or snapshot). ``states``: a recurrent
    group's state at token ``start``, per layer slot its arrays (then ``length`` is 0 and there is no K/V)."""

    group: int
    start: int
    length: int
    keys: tuple[mx.array, ...]  # per layer slot; a packed one a QuantizedArray (a hot pool under --kv-bits)
    values: tuple[mx.array, ...]
    checkpoint: int | None = None
    states: tuple[tuple[mx.array, ...], ...] = ()

    @property
    def arrays(self) -> list[mx.array]:
        """Every array the slice holds (K and V, each of a packed one's words, scales and biases; or a
        state's)."""
        held = [part for kv in (*self.keys, *self.values) for part in (kv if isinstance(kv, tuple) else (kv,))]
        return [*held, *(a for state in self.states for a in state)]


def state_slice(group: int, offset: int, states: tuple[tuple[mx.array, ...], ...],
                checkpoint: int | None = None) -> LayerSlice:
    """A recurrent group's state at ``offset`` tokens (per layer slot its arrays)."""
    return LayerSlice(group, offset, 0, (), (), checkpoint, states)
