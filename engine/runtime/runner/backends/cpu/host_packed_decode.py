"""A decode batch's attention on the CPU over K/V the hot pool holds packed (``--kv-bits``), in compiled loops.

``host_decode.py`` for ``QuantizedFullKV`` rows: each row's parts (its
shared segments, then its own arrays) are read where they lie, as the three
arrays of their packing (words, scales, biases), and the loops
(``packed_kernels.batch_rows_packed``) unpack one position at a time as the
row's queries use it. Through MLX the same step unpacks every row's whole
K/V into new float32 arrays a layer (``host_kv.UnpackedAttention``) and
leaves the host decode step (``host_forward.py``): 8 agents on SmolLM2
decoded at 0.47x of full precision that way, and at 0.94-1.07x through
these loops (bench_kv_bits, the 2-core x86 box). A claimed position
(``HostFullKV.claim_one``) is packed by the loops themselves
(``packed_kernels.pack_last``: MLX's CPU quantize, bit for bit).

A sequence feeding several tokens (a speculative step's drafts, a prompt
chunk riding a decode step) attends through BLAS as with float32 K/V
(``host_verify_attention``), over its parts unpacked once for all its
tokens (:func:`attend_groups`), after its own tokens' keys and values are
packed into the positions it claimed: its tokens see the values the pool
then holds, as through MLX.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from engine.runtime.runner.backends.cpu import host_verify_attention
from engine.runtime.runner.backends.cpu.host_decode import (
    NewPositions,
    PartArrays,
    address_of,
    hidden_addresses,
    masks_apply,
    run_shares,
    thread_shares,
    worker_count,
)


def warm_up() -> None:
    """Load the decode loops: ``host_decode``'s, then the packed ones (an 8-bit and a 4-bit row, each packing
    its own position); raises where they cannot load."""
    from engine.runtime.runner.backends.cpu import host_decode

    host_decode.warm_up()
    for bits in (8, 4):
        arrays = mx.quantize(mx.ones((1, 1, 2, 32)), group_size=32, bits=bits)
        parts = [[(tuple(arrays), tuple(mx.array(np.array(a)) for a in arrays), 2)] for _ in range(2)]
        new = np.ones((2, 1, 32), dtype=np.float32)
        attend_host(np.zeros((2, 2, 32), dtype=np.float32), parts, new, new, [None, 1], bits, 32)


def is_packed(parts_per_row: Sequence[Sequence[PartArrays]]) -> bool:
    """Whether the rows' K/V are packed (every row's: a batch's rows share their pool's packing)."""
    return all(isinstance(parts[-1][0], tuple) for parts in parts_per_row)


def applies(queries: mx.array, parts_per_row: Sequence[Sequence[PartArrays]], masks: Sequence[Any],
            sinks: Any) -> bool:
    """Whether :func:`attend` computes this batch: one float32 query per row over float32 packings, no sinks,
    masks it can apply (None, causal, or a boolean per key)."""
    return (sinks is None and len(parts_per_row) > 1 and queries.shape[2] == 1 and queries.dtype == mx.float32
            and is_packed(parts_per_row) and parts_per_row[0][-1][0][1].dtype == mx.float32
            and masks_apply(masks, parts_per_row))


def attend(queries: mx.array, parts_per_row: Sequence[Sequence[PartArrays]], scale: float, masks: Sequence[Any],
           bits: int, group: int, new: NewPositions | None = None, workers: Executor | None = None) -> mx.array:
    """``host_decode.attend`` over packed parts (``bits`` a value, a scale and bias per ``group``)."""
    key_masks = [m if isinstance(m, mx.array) else None for m in masks]
    mx.eval(queries, [(k, v) for parts in parts_per_row for k, v, _ in parts],
            [m for m in key_masks if m is not None], new[:2] if new is not None else [])
    scaled = np.asarray(queries)[:, :, 0, :] * np.float32(scale)
    new_keys = new_values = None
    claimed: Sequence[Optional[int]] = ()
    if new is not None:
        new_keys, new_values, claimed = np.asarray(new[0])[:, :, 0, :], np.asarray(new[1])[:, :, 0, :], new[2]
    hidden = [None if m is None else np.asarray(m) for m in key_masks]
    out = attend_host(scaled, parts_per_row, new_keys, new_values, claimed, bits, group, hidden, workers)
    return mx.array(out[:, :, None, :])


def attend_host(scaled: np.ndarray, parts_per_row: Sequence[Sequence[PartArrays]], new_keys: np.ndarray | None,
                new_values: np.ndarray | None, claimed: Sequence[Optional[int]], bits: int, group: int,
                hidden: Sequence[np.ndarray | None] | None = None, workers: Executor | None = None) -> np.ndarray:
    """``host_decode.attend_host`` over packed parts: ``scaled`` (batch, heads, dim) queries times the scale,
    ``new_keys``/``new_values`` (batch, kv_heads, dim) packed into each claimed position first. Returns
    (batch, heads, v_dim)."""
    from engine.runtime.runner.backends.cpu import packed_kernels

    scaled = np.ascontiguousarray(scaled, dtype=np.float32)
    batch, heads, _ = scaled.shape
    first_words = parts_per_row[0][0][1][0]
    kv_heads, v_dim = first_words.shape[1], first_words.shape[-1] * 32 // bits
    out = np.empty((batch, heads, v_dim), dtype=np.float32)
    alive: list[np.ndarray] = []  # every buffer whose address the table holds, until the kernels return
    table = np.empty((sum(len(parts) for parts in parts_per_row), packed_kernels.PACKED_COLUMNS), dtype=np.int64)
    row_parts = np.zeros(batch + 1, dtype=np.int64)
    writes = np.array([at is not None for at in claimed] or [False] * batch, dtype=np.int64)
    for b, at in enumerate(claimed):
        if at is not None:
            assert parts_per_row[b][-1][2] == at + 1, "a claimed position is the last key of its row"
    if writes.any():
        new_keys = np.ascontiguousarray(new_keys, dtype=np.float32)
        new_values = np.ascontiguousarray(new_values, dtype=np.float32)
    else:
        new_keys = new_values = np.zeros((batch, 1, 1), dtype=np.float32)  # (never read)
    line = 0
    for b, parts in enumerate(parts_per_row):
        for p, (keys, values, length) in enumerate(parts):
            in_place = bool(writes[b]) and p == len(parts) - 1
            arrays = [_own(a, alive, in_place) for a in (*keys, *values)]
            table[line] = (*(address for address, _ in arrays), arrays[0][1], length)
            line += 1
        row_parts[b + 1] = line
    addresses = hidden_addresses(hidden, batch, alive)
    keys_per_row = [sum(n for _, _, n in parts) for parts in parts_per_row]
    shares = thread_shares(keys_per_row, 1 if workers is None else worker_count())
    run_shares(lambda share: packed_kernels.batch_rows_packed(
        scaled, table, row_parts, addresses, kv_heads, out, share[0], share[-1] + 1, new_keys, new_values, writes,
        bits, group), shares, workers)
    del alive
    return out


def attend_groups(scaled: np.ndarray, parts_per_row: Sequence[Sequence[PartArrays]], new_keys: np.ndarray,
                  new_values: np.ndarray, claimed: Sequence[int], widths: Sequence[int], bits: int, group: int,
                  workers: Executor | None = None) -> np.ndarray:
    """``host_verify_attention.attend_groups`` over packed parts: each group's own keys and values packed into its
    claimed positions, then its parts unpacked (up to its last token's position) and attended to through BLAS."""
    from engine.runtime.runner.backends.cpu import packed_kernels

    starts = np.cumsum([0, *widths])
    unpacked_rows: list[list[tuple[np.ndarray, np.ndarray, int]]] = [[] for _ in parts_per_row]
    held_keys, held_values = np.empty_like(new_keys), np.empty_like(new_values)
    for g in range(len(widths)):
        first, end = int(starts[g]), int(starts[g + 1])
        last = parts_per_row[end - 1]
        own_keys, own_values, _ = last[-1]
        if list(claimed[first:end]) != list(range(claimed[first], claimed[first] + end - first)):
            raise RuntimeError("a sequence's claimed positions are not consecutive")
        for packed, new in ((own_keys, new_keys[first:end]), (own_values, new_values[first:end])):
            words, scales, biases = (_writable(a) for a in packed)
            packed_kernels.pack_positions(words.reshape(-1).view(np.uint8), scales.reshape(-1), biases.reshape(-1),
                                          words.shape[1], claimed[first], np.ascontiguousarray(new, dtype=np.float32),
                                          bits, group)
        unpacked = [(_unpacked(k, n, bits, group), _unpacked(v, n, bits, group)) for k, v, n in last]
        for r in range(first, end):
            unpacked_rows[r] = [(k, v, n) for (k, v), (_, _, n) in zip(unpacked, parts_per_row[r])]
        own_k, own_v = unpacked[-1]
        held_keys[first:end] = own_k[0][:, claimed[first]:claimed[end - 1] + 1].transpose(1, 0, 2)
        held_values[first:end] = own_v[0][:, claimed[first]:claimed[end - 1] + 1].transpose(1, 0, 2)
    # (the positions are written again with the values they now hold: unpacked, what the pool keeps)
    return host_verify_attention.attend_groups(scaled, unpacked_rows, held_keys, held_values, claimed, widths,
                                               workers)


def _writable(array: mx.array) -> np.ndarray:
    host = np.asarray(array)
    if not (host.flags.c_contiguous and host.flags.writeable):
        raise RuntimeError("a claimed position's packed cache is not one writable contiguous buffer")
    return host[0]


def _unpacked(packed: tuple[mx.array, ...], length: int, bits: int, group: int) -> np.ndarray:
    """The first ``length`` positions of a packed K or V as (1, kv_heads, length, width) float32."""
    from engine.runtime.runner.backends.cpu import packed_kernels

    words, scales, biases = (np.ascontiguousarray(np.asarray(a)[0]) for a in packed)
    heads, capacity = words.shape[0], words.shape[1]
    out = np.empty((1, heads, length, words.shape[2] * 32 // bits), dtype=np.float32)
    packed_kernels.unpack_positions(words.reshape(-1).view(np.uint8), scales.reshape(-1), biases.reshape(-1), capacity,
                                    bits, group, out[0])
    return out


def _own(array: mx.array, alive: list[np.ndarray], in_place: bool) -> tuple[int, int]:
    """The address of one packed array's (1, kv_heads, capacity, width) data and its capacity.

    The pool's arrays are C-contiguous, so this is their own memory; another layout (a view of a shared
    segment) is copied, except ``in_place`` (the loops write there), where a copy would lose the write."""
    own = np.asarray(array)[0]
    if in_place and not own.flags.c_contiguous:
        raise RuntimeError("a claimed decode position's packed cache is not one contiguous buffer")
    own = np.ascontiguousarray(own)
    return address_of(own, alive), own.shape[1]
