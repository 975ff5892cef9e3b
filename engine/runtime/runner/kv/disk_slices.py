"""An agent's resident KV as slices and back: what the cool and disk tiers keep of it.

Every position the cache needs, cut on absolute block boundaries (copies),
its checkpoints the same way, a shared prefix as a cache of its own, and an
empty cache filled from such slices again. The tiers hold slices (plain
arrays and offsets, ``store/layer_slice.py``), never the layer caches.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from engine.store.cache_file import QuantizedArray
from engine.store.layer_slice import LayerSlice, state_slice

from engine.runtime.runner.kv.chunked_kv import ChunkedKV, ChunkState
from engine.runtime.runner.kv.full_kv import FullKV, joined
from engine.runtime.runner.kv.quantized_kv import QuantizedFullKV
from engine.runtime.runner.kv.recurrent_state import RecurrentState, StateSnapshot
from engine.runtime.runner.kv.sequence_kv import (Checkpoint, CheckpointKind, LayerKV, SequenceKV, WindowLike,
                                                  arrays_of)
from engine.runtime.runner.kv.window_kv import WindowKV, WindowState


def cache_slices(kv: SequenceKV, n_tokens: int, full_from: int = 0) -> list[LayerSlice]:
    """Every position the cache needs, cut on absolute block boundaries (copies), for the disk tier.

    ``full_from``: full-attention layers start there (the positions before
    it are in a shared prefix file).
    """
    out: list[LayerSlice] = []
    for group in kv.spec.groups:
        layers = [kv.layers[i] for i in group.layers]
        if group.is_recurrent:
            out += _states_at(group.index, n_tokens, [layer.state_now() for layer in layers])  # type: ignore[union-attr]
            continue
        start = n_tokens - min(n_tokens, _needed(layers[0], n_tokens))
        if group.holds_every_position:
            start = max(start, full_from)
        out += _cut(group.index, layers, start, n_tokens, kv.spec.block_tokens)
    mx.eval([a for s in out for a in s.arrays])
    return out


def prefix_slices(kv: SequenceKV, n_tokens: int) -> list[LayerSlice] | None:
    """Positions ``[0, n_tokens)`` as a cache of their own (a shared prefix for the disk tier), as copies.

    Window layers and recurrent states need their state at ``n_tokens``: the
    cache's own when it ends there, else a checkpoint taken there; None when
    there is neither.
    """
    states: dict[int, WindowState | ChunkState | StateSnapshot] = {}
    if kv.forgets:
        checkpoint = next((c for c in kv.checkpoints if c.offset == n_tokens), None)
        if checkpoint is not None:
            states = dict(zip(kv.window_layer_ids(), checkpoint.states))
        elif kv.offset == n_tokens:
            states = {i: kv.layers[i].state_now() for i in kv.window_layer_ids()}  # type: ignore[union-attr]
        else:
            return None
    out: list[LayerSlice] = []
    for group in kv.spec.groups:
        if group.holds_every_position:
            out += _cut(group.index, [kv.layers[i] for i in group.layers], 0, n_tokens, kv.spec.block_tokens)
            continue
        if group.is_recurrent:
            out += _states_at(group.index, n_tokens, [states[i] for i in group.layers])  # type: ignore[misc]
            continue
        rings = [_ring(kv.layers[i], states[i]) for i in group.layers]  # type: ignore[arg-type]
        start = n_tokens - min(rings[0].needed, n_tokens)
        out += _cut(group.index, rings, start, n_tokens, kv.spec.block_tokens)
    mx.eval([a for s in out for a in s.arrays])
    return out


def checkpoint_slices(kv: SequenceKV) -> tuple[list[dict[str, object]], list[LayerSlice]]:
    """The checkpoints as the disk tier stores them: header entries, and each one's window
    positions cut on block boundaries (``LayerSlice.checkpoint`` = its index in the entries)."""
    entries: list[dict[str, object]] = []
    out: list[LayerSlice] = []
    for index, checkpoint in enumerate(sorted(kv.checkpoints, key=lambda c: c.offset)):
        entries.append({"offset": checkpoint.offset, "kind": checkpoint.kind.value})
        states = dict(zip(kv.window_layer_ids(), checkpoint.states))
        for group in kv.spec.sliding_groups:
            if group.is_recurrent:
                snapshots = [states[i] for i in group.layers]
                out += _states_at(group.index, checkpoint.offset, snapshots, index)  # type: ignore[arg-type]
                continue
            rings = [_ring(kv.layers[i], states[i]) for i in group.layers]  # type: ignore[arg-type]
            start = checkpoint.offset - min(rings[0].needed, checkpoint.offset)
            cut = _cut(group.index, rings, start, checkpoint.offset, kv.spec.block_tokens)
            out += [LayerSlice(s.group, s.start, s.length, s.keys, s.values, index) for s in cut]
    mx.eval([a for s in out for a in s.arrays])
    return entries, out


def load_slices(kv: SequenceKV, n_tokens: int, slices: Sequence[LayerSlice],
                checkpoints: Sequence[dict[str, object]] = ()) -> None:
    """Fill an empty cache from slices (capacity for ``n_tokens`` reserved by the caller).

    Slices of checkpoints become checkpoints again; the caller pays for them.
    """
    own = [s for s in slices if s.checkpoint is None]
    _load_own(kv, n_tokens, own)
    for index, entry in enumerate(checkpoints):
        parts = [s for s in slices if s.checkpoint == index]
        kv.checkpoints.append(_checkpoint_from(kv, int(entry["offset"]), CheckpointKind(entry["kind"]), parts))
    mx.eval([a for c in kv.checkpoints for state in c.states for a in arrays_of(state)])


def _checkpoint_from(kv: SequenceKV, offset: int, kind: CheckpointKind, parts: list[LayerSlice]) -> Checkpoint:
    states: list[WindowState | ChunkState | StateSnapshot] = []
    for index in kv.window_layer_ids():
        layer = kv.layers[index]
        group = kv.spec.group_of(index)
        slot = group.layers.index(index)
        mine = sorted((p for p in parts if p.group == group.index), key=lambda p: p.start)
        if isinstance(layer, RecurrentState):
            states.append(StateSnapshot(offset, tuple(mine[0].states[slot]) if mine else None))
            continue
        ring = layer.blank()
        ring.reserve(offset)
        if mine:
            ring.load_from(mine[0].start, mx.concatenate([p.keys[slot] for p in mine], axis=2),
                           mx.concatenate([p.values[slot] for p in mine], axis=2))
        else:
            ring.load_from(offset, None, None)
        ring.shrink()
        # (A chunked checkpoint keeps only its chunk so far: what it would own after a relayout.)
        states.append(ring.compact(ring.state_now()) if isinstance(ring, ChunkedKV) else ring.state_now())
    return Checkpoint(offset, tuple(states), kind)


def _load_own(kv: SequenceKV, n_tokens: int, slices: Sequence[LayerSlice]) -> None:
    by_group: dict[int, list[LayerSlice]] = {}
    for s in slices:
        by_group.setdefault(s.group, []).append(s)
    for group in kv.spec.groups:
        parts = sorted(by_group.get(group.index, []), key=lambda s: s.start)
        if group.is_recurrent:
            for slot, index in enumerate(group.layers):
                state = kv.layers[index]
                assert isinstance(state, RecurrentState) and len(parts) == 1 and parts[0].start == n_tokens
                state.load(n_tokens, tuple(parts[0].states[slot]))
            continue
        if not parts:
            if not group.holds_every_position:  # a chunked window at its boundary: nothing to hold yet
                for index in group.layers:
                    kv.layers[index].load_from(n_tokens, None, None)  # type: ignore[union-attr]
            continue
        for slot, index in enumerate(group.layers):
            layer = kv.layers[index]
            keys = joined([p.keys[slot] for p in parts])
            values = joined([p.values[slot] for p in parts])
            if isinstance(layer, FullKV):
                layer.load(keys, values)
            else:
                layer.load_from(parts[0].start, keys, values)
    mx.eval([a for layer in kv.layers for a in arrays_of(layer)])


def _needed(layer: LayerKV, n_tokens: int) -> int:
    """How many of the latest positions a layer must keep to continue at ``n_tokens``."""
    if isinstance(layer, FullKV):
        return n_tokens
    return min(layer.needed, n_tokens)


def _positions(layer: LayerKV, start: int, end: int) -> tuple[mx.array | QuantizedArray, mx.array | QuantizedArray]:
    """Copies of positions ``[start, end)``; a layer the hot pool quantizes hands them over packed, as it holds
    them (the tiers and the files keep that format: a position is quantized once)."""
    if isinstance(layer, QuantizedFullKV):
        keys, values = layer.positions(start, end)
        return _packed_copy(keys), _packed_copy(values)
    keys, values = layer.positions(start, end) if isinstance(layer, FullKV) else layer.columns(start, end)
    return mx.contiguous(keys), mx.contiguous(values)


def _packed_copy(packed: Sequence[mx.array]) -> QuantizedArray:
    return QuantizedArray(*(mx.contiguous(a) for a in packed))


def _ring(layer: LayerKV, state: WindowState | ChunkState) -> WindowLike:
    """A window layer of ``layer``'s kind, as it was in ``state``."""
    assert isinstance(layer, (WindowKV, ChunkedKV))
    ring = layer.blank()
    ring.restore(state)  # type: ignore[arg-type]
    return ring


def _states_at(group: int, offset: int, snapshots: Sequence[StateSnapshot],
               checkpoint: int | None = None) -> list[LayerSlice]:
    """A recurrent group's layers at ``offset`` tokens as one state slice (none before any token). The
    arrays are the state's own (values: a later pass replaces them, never writes into them), made
    contiguous for the writer."""
    assert all(s.offset == offset for s in snapshots), ([s.offset for s in snapshots], offset)
    if offset == 0 or snapshots[0].arrays is None:
        return []
    states = tuple(tuple(mx.contiguous(a) for a in s.arrays or ()) for s in snapshots)
    return [state_slice(group, offset, states, checkpoint)]


def _cut(group: int, layers: Sequence[LayerKV], start: int, end: int, block: int) -> list[LayerSlice]:
    """Positions ``[start, end)`` of ``layers`` as copies, one slice per absolute block."""
    out: list[LayerSlice] = []
    pos = start
    while pos < end:
        stop = min((pos // block + 1) * block, end)
        keys, values = zip(*(_positions(layer, pos, stop) for layer in layers))
        out.append(LayerSlice(group, pos, stop - pos, tuple(keys), tuple(values)))
        pos = stop
    return out
