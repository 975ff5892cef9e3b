"""The structural checks on a cache file's tensors, shared by the writer and the reader.

The reader runs them so that any defect in a file on disk surfaces as one
CacheCorruptionError naming it, before anything is restored; the writer runs
the same ones so it never writes a file the reader would reject. The checks:
tensors tile the data section exactly, the geometry matches the model's spec,
each group's blocks cover the cache contiguously (a full-attention group from
where the prefix reference ends), each checkpoint's blocks cover every
sliding-window group up to its offset, each recurrent group has exactly one
state at the cache's end and one at each checkpoint's offset, of the spec's
shapes and dtypes, and the checksum holds.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from engine.domain.block_layout import first_needed_position
from engine.errors import CacheCorruptionError

from engine.store.cache_file.format import (
    BLOCK_NAME,
    CRC_DIGITS,
    STATE_NAME,
    KV_DTYPES,
    PACKED_DTYPE,
    TOKEN_DTYPE,
    CHECKSUM_ALGORITHM,
    TOKENS,
    CacheHeader,
    KVQuantization,
    QuantizedArray,
    Dtype,
    Entry,
    description_fingerprint,
    short_quote,
)


# -- the file as a whole -----------------------------------------------------------------------
def check_offsets(entries: Iterable[Entry], data_len: int) -> None:
    """Tensors must tile the data section exactly: no overlap, no gap, nothing past the end."""
    position = 0
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin < position:
            raise CacheCorruptionError(
                f"tensor {short_quote(repr(entry.name))} at bytes [{entry.begin}, {entry.end}) "
                f"overlaps the tensor ending at {position}")
        if entry.begin > position:
            raise CacheCorruptionError(
                f"data bytes [{position}, {entry.begin}) belong to no tensor")
        position = entry.end
    if position > data_len:
        raise CacheCorruptionError(
            f"truncated: the tensors need {position} bytes of data, the file holds {data_len}")
    if position < data_len:
        raise CacheCorruptionError(f"{data_len - position} trailing bytes after the last tensor")


def token_entry(entries: dict[str, Entry], n_tokens: int) -> Entry:
    entry = entries.get(TOKENS)
    if entry is None:
        raise CacheCorruptionError("no token_ids tensor")
    if entry.dtype != TOKEN_DTYPE.code or entry.shape != (n_tokens,):
        raise CacheCorruptionError(
            f"token_ids is {entry.dtype} {list(entry.shape)}, the header needs U32 [{n_tokens}]")
    return entry


def check_identity(
    header: CacheHeader, digest: str, fingerprint: str, model_name: str | None
) -> None:
    """The file was made by the loaded model, with the same cache layout."""
    if header.model_digest != digest:
        made_by = f"{header.model_name}@{header.model_digest[:16]}"
        raise CacheCorruptionError(
            f"cache made by model {made_by}, loaded model is {model_name or ''}@{digest[:16]}")
    if description_fingerprint(header.spec) != header.spec_fingerprint:
        raise CacheCorruptionError("the header's spec does not match its own fingerprint")
    if header.spec_fingerprint != fingerprint:
        raise CacheCorruptionError(
            f"spec fingerprint mismatch: cache {header.spec_fingerprint[:16]}, "
            f"loaded model {fingerprint[:16]} (block size, KV dtype or layer grouping changed)")


def check_checksum(head: bytes, checksum_at: int, expected: str, data: np.ndarray) -> None:
    """crc32 over the head, its own digits read as ``0``, then the data: as the writer did."""
    zeroed = bytearray(head)
    zeroed[checksum_at : checksum_at + CRC_DIGITS] = b"0" * CRC_DIGITS
    actual = f"{CHECKSUM_ALGORITHM}:{zlib.crc32(data, zlib.crc32(zeroed)):08x}"
    if actual != expected:
        raise CacheCorruptionError(
            f"checksum mismatch: header says {expected}, contents give {actual}")


# -- tensors against the spec ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Group:
    """A layer group as the spec describes it: its layers, its window or chunk, its K/V shape; a recurrent
    group: per layer its state arrays' shapes (without the batch axis) and dtypes."""

    layers: int
    window: int | None
    chunk: int | None
    kv_heads: int
    head_dim: int
    v_head_dim: int
    state: tuple[tuple[tuple[int, ...], str], ...] | None = None

    @property
    def recurrent(self) -> bool:
        return self.state is not None

    @property
    def forgets(self) -> bool:
        """Whether the group cannot go back to any earlier position (a window, a chunk, a recurrent state)."""
        return self.window is not None or self.chunk is not None or self.state is not None


@dataclass(frozen=True, slots=True)
class Geometry:
    n_layers: int
    dtype: Dtype
    block_tokens: int
    groups: dict[int, _Group]

    @property
    def head_dims(self) -> set[int]:
        """The K and V widths of the groups that hold K/V (what quantization must divide)."""
        return {d for g in self.groups.values() if not g.recurrent for d in (g.head_dim, g.v_head_dim)}


@dataclass(frozen=True, slots=True)
class BlockEntries:
    group: int
    start: int
    length: int
    keys: tuple[Entry | QuantizedArray, ...]  # QuantizedArrays of entries in a quantized file
    values: tuple[Entry | QuantizedArray, ...]
    checkpoint: int | None = None
    states: tuple[tuple[Entry, ...], ...] = ()  # a recurrent group's state: per layer slot its arrays

    @property
    def end(self) -> int:
        return self.start + self.length


# Blocks by checkpoint (None: the cache's own), then by group, each run in token order.
Runs = dict[int | None, dict[int, list[BlockEntries]]]


def full_attention_groups(spec: dict[str, Any]) -> set[int]:
    """The groups of a file's cache layout that hold every position (no window, no chunk)."""
    return {index for index, group in spec_geometry(spec).groups.items() if not group.forgets}


def spec_geometry(spec: dict[str, Any]) -> Geometry:
    """The shape facts of a ``ModelCacheSpec.describe()`` dict (a group's own geometry, where it has one)."""
    try:
        groups = {g["index"]: _group(g, g.get("geometry") or spec) for g in spec["groups"]}
        return Geometry(spec["n_layers"], KV_DTYPES[spec["dtype"]], spec["block_tokens"], groups)
    except (KeyError, TypeError, ValueError) as err:
        raise CacheCorruptionError(
            f"spec is malformed or unsupported ({short_quote(repr(err))})") from None


def _group(group: dict[str, Any], geometry: dict[str, Any]) -> _Group:
    kind = group["kind"]
    if kind == "recurrent":
        arrays = tuple((tuple(int(n) for n in shape), str(dtype)) for shape, dtype in group["state"]["arrays"])
        if not arrays or any(dtype not in KV_DTYPES or not shape for shape, dtype in arrays):
            raise ValueError(f"unsupported recurrent state {arrays!r}")
        return _Group(len(group["layers"]), None, None, geometry["n_kv_heads"], geometry["head_dim"],
                      geometry["v_head_dim"], arrays)
    window = int(kind.removeprefix("sliding-")) if kind.startswith("sliding-") else None
    chunk = int(kind.removeprefix("chunked-")) if kind.startswith("chunked-") else None
    if kind != "global" and window is None and chunk is None:
        raise ValueError(f"unknown group kind {kind!r}")
    return _Group(len(group["layers"]), window, chunk, geometry["n_kv_heads"], geometry["head_dim"],
                  geometry["v_head_dim"])


def check_blocks(geometry: Geometry, entries: dict[str, Entry], header: CacheHeader) -> Runs:
    """Every tensor is a K or V of a whole block; the blocks cover the cache and its checkpoints.

    The header's fields must already have passed ``_check_fields``.
    """
    layers = {len(header.cache_classes), len(header.cache_meta)}
    if layers != {geometry.n_layers}:
        raise CacheCorruptionError(f"header describes {sorted(layers)} layer caches, "
                                   f"the spec has {geometry.n_layers} layers")
    quantization = header.quantization
    if quantization is not None:
        _check_quantization(geometry, quantization)
    runs = _group_blocks(geometry, entries, quantization)
    orphans = sorted(i for i in runs if i is not None and i >= len(header.checkpoints))
    if orphans:
        raise CacheCorruptionError(f"tensors of checkpoint {orphans[0]}, which the header "
                                   f"does not list (it lists {len(header.checkpoints)})")
    main = runs.get(None, {})
    shared = header.prefix["n_tokens"] if header.prefix else 0
    for index, group in geometry.groups.items():
        if group.recurrent:
            _check_state(f"group {index}", main.get(index, []), header.n_tokens)
        else:
            _check_run(index, main.get(index, []), header.n_tokens, group, shared)
    for i, checkpoint in enumerate(header.checkpoints):
        _check_checkpoint(geometry, i, checkpoint["offset"], runs.get(i, {}))
    kv_bytes = sum(e.end - e.begin for name, e in entries.items() if name != TOKENS)
    if kv_bytes != header.tensor_bytes:
        raise CacheCorruptionError(
            f"header says {header.tensor_bytes} tensor bytes, the tensors hold {kv_bytes}")
    return runs


def _check_quantization(geometry: Geometry, quantization: KVQuantization) -> None:
    """The quantized groups exist and hold K/V, their head dims split into whole groups, and a group into whole
    packed words."""
    for group in quantization.groups or ():
        if group not in geometry.groups or geometry.groups[group].recurrent:
            raise CacheCorruptionError(f"kv_quantization names group {group}, which holds no K/V in the spec")
    quantized = [g for i, g in geometry.groups.items() if not g.recurrent and quantization.covers(i)]
    for dim in sorted({d for g in quantized for d in (g.head_dim, g.v_head_dim)}):
        if dim % quantization.group_size or dim * quantization.bits % 32:
            raise CacheCorruptionError(
                f"kv_quantization {quantization.bits} bits in groups of {quantization.group_size} "
                f"does not fit head_dim {dim}")


def _group_blocks(
    geometry: Geometry, entries: dict[str, Entry], quantization: KVQuantization | None = None,
) -> Runs:
    """The K/V tensors gathered into blocks by name, each group's blocks in token order (a recurrent
    group's states, one per position, as blocks of no tokens)."""
    found: dict[tuple[int, int, int], dict[tuple[int, str, str | None], Entry]] = {}
    states: dict[tuple[int, int, int], dict[tuple[int, int], Entry]] = {}
    for name, entry in entries.items():
        if name == TOKENS:
            continue
        match = BLOCK_NAME.fullmatch(name)
        if match is None:
            state = STATE_NAME.fullmatch(name)
            if state is None:
                raise CacheCorruptionError(f"unexpected tensor {short_quote(repr(name))}")
            checkpoint = -1 if state[1] is None else int(state[1])
            states.setdefault((checkpoint, int(state[2]), int(state[3])), {})[(int(state[4]), int(state[5]))] = entry
            continue
        checkpoint = -1 if match[1] is None else int(match[1])  # -1 sorts the cache's own first
        group, start, slot = int(match[2]), int(match[3]), int(match[4])
        found.setdefault((checkpoint, group, start), {})[(slot, match[5], match[6])] = entry
    runs: Runs = {}
    for (checkpoint, group, start), tensors in sorted(found.items()):
        packed = quantization if quantization is not None and quantization.covers(group) else None
        block = _block(geometry, None if checkpoint < 0 else checkpoint, group, start, tensors, packed)
        runs.setdefault(block.checkpoint, {}).setdefault(group, []).append(block)
    for (checkpoint, group, offset), arrays in sorted(states.items()):
        block = _state(geometry, None if checkpoint < 0 else checkpoint, group, offset, arrays)
        runs.setdefault(block.checkpoint, {}).setdefault(group, []).append(block)
    return runs


def _state(geometry: Geometry, checkpoint: int | None, group: int, offset: int,
           arrays: dict[tuple[int, int], Entry]) -> BlockEntries:
    """A recurrent group's state at ``offset``: every layer's arrays, of the spec's shapes and dtypes
    (never quantized: a state is full precision at rest)."""
    name = ("" if checkpoint is None else f"c{checkpoint}.") + f"g{group}.s{offset}"
    facts = geometry.groups.get(group)
    if facts is None or facts.state is None:
        raise CacheCorruptionError(f"state {name}: group {group} is not a recurrent group of the spec")
    expected = facts.state
    if set(arrays) != {(slot, j) for slot in range(facts.layers) for j in range(len(expected))}:
        raise CacheCorruptionError(f"state {name} lacks arrays of some of the group's {facts.layers} layers "
                                   f"({len(expected)} each) or has arrays the spec does not have")
    for (slot, j), entry in arrays.items():
        shape, dtype = expected[j]
        if entry.dtype != KV_DTYPES[dtype].code or entry.shape != (1, *shape):
            raise CacheCorruptionError(f"tensor {entry.name} is {entry.dtype} {list(entry.shape)}, "
                                       f"the spec's state needs {KV_DTYPES[dtype].code} {[1, *shape]}")
    states = tuple(tuple(arrays[(slot, j)] for j in range(len(expected))) for slot in range(facts.layers))
    return BlockEntries(group, offset, 0, (), (), checkpoint, states)


def _check_state(what: str, run: list[BlockEntries], offset: int) -> None:
    """A recurrent group holds exactly one state, at ``offset`` (none before any token)."""
    if offset == 0 and not run:
        return
    if [b.start for b in run] != [offset]:
        raise CacheCorruptionError(f"{what} holds recurrent states at tokens {[b.start for b in run]}, "
                                   f"it needs exactly one, at token {offset}")


_PARTS = (None, "scales", "biases")  # a quantized K or V: packed words, then its group parameters


def _block(
    geometry: Geometry, checkpoint: int | None, group: int, start: int,
    tensors: dict[tuple[int, str, str | None], Entry], quantization: KVQuantization | None = None,
) -> BlockEntries:
    name = ("" if checkpoint is None else f"c{checkpoint}.") + f"g{group}.b{start}"
    if group not in geometry.groups:
        raise CacheCorruptionError(
            f"tensor group {group} is not in the spec (groups {sorted(geometry.groups)})")
    facts = geometry.groups[group]
    if facts.recurrent:
        raise CacheCorruptionError(f"block {name} holds K/V of recurrent group {group}, which keeps a state")
    width = facts.layers
    parts = _PARTS if quantization is not None else (None,)
    if set(tensors) != {(slot, kind, part) for slot in range(width) for kind in "kv" for part in parts}:
        what = "k or v (packed, scales and biases)" if quantization is not None else "k or v"
        raise CacheCorruptionError(f"block {name} lacks {what} of some of the group's {width} layers "
                                   "or has tensors its format does not have")
    if quantization is None:
        keys: tuple[Any, ...] = tuple(tensors[(slot, "k", None)] for slot in range(width))
        values: tuple[Any, ...] = tuple(tensors[(slot, "v", None)] for slot in range(width))
        lengths = {_tensor_length(geometry, facts, e, facts.head_dim) for e in keys}
        lengths |= {_tensor_length(geometry, facts, e, facts.v_head_dim) for e in values}
    else:
        keys = tuple(QuantizedArray(*(tensors[(slot, "k", p)] for p in _PARTS)) for slot in range(width))
        values = tuple(QuantizedArray(*(tensors[(slot, "v", p)] for p in _PARTS)) for slot in range(width))
        lengths = {_quantized_length(geometry, facts, q, facts.head_dim, quantization) for q in keys}
        lengths |= {_quantized_length(geometry, facts, q, facts.v_head_dim, quantization) for q in values}
    length = min(lengths)
    room = geometry.block_tokens - start % geometry.block_tokens  # blocks sit on boundaries
    if len(lengths) != 1 or not 1 <= length <= room:
        raise CacheCorruptionError(f"block {name} holds {sorted(lengths)} tokens, "
                                   f"which does not fit one {geometry.block_tokens}-token block")
    return BlockEntries(group, start, length, keys, values, checkpoint)


def _tensor_length(geometry: Geometry, group: _Group, entry: Entry, head_dim: int,
                   dtype: Dtype | None = None) -> int:
    stored_as = "the spec stores" if dtype is None else "quantized K/V are"
    dtype = dtype or geometry.dtype
    if entry.dtype != dtype.code:
        raise CacheCorruptionError(f"tensor {entry.name} has unexpected dtype {entry.dtype}, "
                                   f"{stored_as} {dtype.name}")
    shape = entry.shape
    if len(shape) != 4 or shape[0] != 1 or shape[1] != group.kv_heads or shape[3] != head_dim:
        raise CacheCorruptionError(f"tensor {entry.name} has shape {list(shape)}, "
                                   f"the spec needs [1, {group.kv_heads}, n, {head_dim}]")
    return shape[2]


def _quantized_length(
    geometry: Geometry, group: _Group, array: QuantizedArray, head_dim: int, quantization: KVQuantization,
) -> int:
    """Packed words [1, H, n, head_dim * bits / 32], scales and biases [1, H, n, head_dim / group]."""
    lengths = {_tensor_length(geometry, group, array.packed, head_dim * quantization.bits // 32, PACKED_DTYPE)}
    for part in (array.scales, array.biases):
        lengths.add(_tensor_length(geometry, group, part, head_dim // quantization.group_size))
    if len(lengths) != 1:
        raise CacheCorruptionError(f"tensor {array.packed.name}: its packed words, scales and biases "
                                   f"hold {sorted(lengths)} tokens")
    return lengths.pop()


def _check_run(
    index: int, run: list[BlockEntries], n_tokens: int, group: _Group, shared: int
) -> None:
    """A group's blocks are contiguous, end at the last token, and start where they must.

    ``shared`` is the prefix reference's token count (0 without one): the
    prefix file holds a full-attention group's tokens before it.
    """
    _check_contiguous(f"group {index}", run)
    if not run and _at_chunk_boundary(n_tokens, group):
        return
    end = run[-1].end if run else (0 if group.forgets else shared)
    if end != n_tokens:
        raise CacheCorruptionError(
            f"group {index} covers tokens up to {end}, the cache holds {n_tokens}")
    if not group.forgets:
        _check_global_start(index, run, shared)
    else:
        _check_window_start(index, run, _first_needed(n_tokens, group))


def _at_chunk_boundary(n_tokens: int, group: _Group) -> bool:
    """A chunked group at a chunk boundary holds nothing: the next token starts a new chunk."""
    return group.chunk is not None and n_tokens % group.chunk == 0


def _first_needed(n_tokens: int, group: _Group) -> int:
    """The first position a window group must hold to go on at ``n_tokens``: its window's, or its chunk's."""
    if group.chunk is not None:
        return n_tokens // group.chunk * group.chunk
    return first_needed_position(n_tokens, group.window)


def _check_global_start(index: int, run: list[BlockEntries], shared: int) -> None:
    """Exactly from ``shared``: earlier would copy the prefix file, later would lose tokens."""
    if run and run[0].start != shared:
        held = f"a prefix reference of {shared} tokens" if shared else "no prefix reference"
        raise CacheCorruptionError(f"global group {index} starts at token {run[0].start}, "
                                   f"but with {held} it must start at token {shared}")


def _check_window_start(index: int, run: list[BlockEntries], needed: int) -> None:
    """A window group may drop blocks before its window (or chunk), never one inside it."""
    if run and run[0].start > needed:
        raise CacheCorruptionError(
            f"group {index} starts at token {run[0].start}, but must hold token {needed} on")


def _check_contiguous(what: str, run: list[BlockEntries]) -> None:
    for before, after in pairwise(run):
        if after.start != before.end:
            raise CacheCorruptionError(f"{what} is not contiguous: a block starts at "
                                       f"{after.start} after one ending at {before.end}")


def _check_checkpoint(
    geometry: Geometry, i: int, offset: int, runs: dict[int, list[BlockEntries]]
) -> None:
    """Checkpoint ``i`` holds each sliding-window group as it stood at ``offset``, and no more.

    Full-attention groups never shrink, so the cache's own blocks already hold
    their state at any earlier offset: a checkpoint of one would be a copy.
    """
    for index, group in geometry.groups.items():
        run = runs.get(index, [])
        if group.recurrent:
            _check_state(f"checkpoint {i} group {index}", run, offset)
            continue
        if not group.forgets:
            if run:
                raise CacheCorruptionError(f"checkpoint {i} has blocks of global group {index}; "
                                           "checkpoints hold only sliding-window groups")
            continue
        if not run:
            if _at_chunk_boundary(offset, group):
                continue
            raise CacheCorruptionError(
                f"checkpoint {i} has no blocks of sliding-window group {index}")
        what = f"checkpoint {i} group {index}"
        _check_contiguous(what, run)
        _check_checkpoint_span(what, run[0].start, run[-1].end, offset, group, geometry.block_tokens)


def _check_checkpoint_span(
    what: str, start: int, end: int, offset: int, group: _Group, block_tokens: int
) -> None:
    """Ends at ``offset`` and holds the ``window - 1`` tokens the next one attends to (a chunked group: its
    chunk so far).

    It may hold more, whole blocks cut from the cache, but never more than a
    window rounded up to blocks (a chunk and a block more): a checkpoint cannot
    quietly carry a history.
    """
    if end != offset:
        raise CacheCorruptionError(f"{what} covers tokens up to {end}, its offset is {offset}")
    if group.chunk is not None:
        latest = offset // group.chunk * group.chunk
        span = (math.ceil(group.chunk / block_tokens) + 1) * block_tokens
    else:
        assert group.window is not None
        latest = max(0, offset - (group.window - 1))
        span = math.ceil(group.window / block_tokens) * block_tokens
    if start > latest:
        raise CacheCorruptionError(
            f"{what} starts at token {start}, but must hold token {latest} on")
    earliest = max(0, offset - span)
    if start < earliest:
        raise CacheCorruptionError(f"{what} starts at token {start}, before token {earliest}: "
                                   "more than its window's blocks before its offset")
