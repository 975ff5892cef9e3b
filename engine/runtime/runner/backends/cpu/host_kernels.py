"""Compiled loops (numba) for a decode batch's attention, reading each row's cache where it lies.

A part of a row's keys (its own cache, or a shared segment) is the start
of an array laid out (1, kv_heads, capacity, dim): within a head, positions
are consecutive runs of ``dim`` floats, and heads sit ``stride`` floats
apart. :func:`batch_rows` gets each part's address (``_flat`` in
host_decode.py) and reads it as a flat buffer, so every inner loop runs
over contiguous floats and the compiler vectorizes it.

The arithmetic is MLX's unfused attention's: queries arrive scaled, scores
are float32 dot products, one softmax per query over all of the row's
scores (the max subtracted, float32 exp and sum, each weight divided by the
sum), then the weighted sum of values. Dot products and sums may be
reassociated for SIMD (``fastmath`` reassoc and contract only: infinities,
NaNs and exp keep their meaning), as BLAS's blocked sums are; the
real-model tests hold greedy tokens to mlx-lm's.

Compiled on first use and cached (``cache=True``: beside this file, or in
numba's per-user cache where that is not writable); ``nogil``, so threads
run rows in parallel.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

_FAST = {"reassoc", "contract"}
# MLX's mx.finfo(float32).min: the score of a hidden key (mx.where(mask, scores, min)).
LOWEST = np.float32(-3.4028235e38)


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def part_scores(q, keys, stride, length, column, scores):  # pragma: no cover (compiled)
    """``scores[h, r, column + p]`` = query ``h * repeats + r`` . key ``p`` of head ``h``, for ``p < length``."""
    kv_heads, repeats, _ = scores.shape
    dim = q.shape[1]
    for h in range(kv_heads):
        for p in range(length):
            at = h * stride + p * dim
            key = keys[at:at + dim]  # (a slice: indices the compiler knows are in range, so it vectorizes)
            for r in range(repeats):
                qr = q[h * repeats + r]
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += qr[d] * key[d]
                scores[h, r, column + p] = acc


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def softmax(scores, total, hidden, masked):  # pragma: no cover (compiled)
    """Each query's first ``total`` scores become weights; ``hidden[p]`` (when ``masked``) hides key ``p``."""
    kv_heads, repeats, _ = scores.shape
    for h in range(kv_heads):
        for r in range(repeats):
            s = scores[h, r]
            if masked:
                for p in range(total):
                    if hidden[p]:
                        s[p] = LOWEST
            top = s[0]
            for p in range(1, total):
                if s[p] > top:
                    top = s[p]
            denominator = np.float32(0.0)
            for p in range(total):
                e = np.float32(math.exp(s[p] - top))
                s[p] = e
                denominator += e
            for p in range(total):
                s[p] = s[p] / denominator


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def part_values(scores, values, stride, length, column, out, accumulate):  # pragma: no cover (compiled)
    """``out[h * repeats + r]`` (+)= sum over ``p < length`` of weight ``column + p`` times value ``p`` of head ``h``."""
    kv_heads, repeats, _ = scores.shape
    v_dim = out.shape[1]
    for h in range(kv_heads):
        if not accumulate:
            for r in range(repeats):
                out[h * repeats + r, :] = 0.0
        for p in range(length):
            at = h * stride + p * v_dim
            value = values[at:at + v_dim]  # read once for the head's queries
            for r in range(repeats):
                w = scores[h, r, column + p]
                row = out[h * repeats + r]
                for d in range(v_dim):
                    row[d] += w * value[d]


def _pointer_from_address(element):
    """An intrinsic: the ``element`` buffer at an integer address (one numpy handed over, kept alive by the caller)."""
    pointer = types.CPointer(element)

    @intrinsic
    def at(typingctx, address):  # pragma: no cover (compiled)
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(pointer))

        return pointer(types.int64), codegen

    return at


floats_at = _pointer_from_address(types.float32)
bytes_at = _pointer_from_address(types.uint8)


# Columns of the ``parts`` table batch_rows reads: one part per line.
KEYS, K_STRIDE, VALUES, V_STRIDE, LENGTH = range(5)
PART_COLUMNS = 5


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def write_last(address, stride, length, new):  # pragma: no cover (compiled)
    """Copy ``new`` (kv_heads, dim) into position ``length - 1`` of the flat (1, kv_heads, capacity, dim) floats
    at ``address``, whose heads are ``stride`` floats apart."""
    kv_heads, dim = new.shape
    at = (length - 1) * dim
    flat = numba.carray(floats_at(address), ((kv_heads - 1) * stride + at + dim,))
    for h in range(kv_heads):
        flat[h * stride + at:h * stride + at + dim] = new[h]


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def batch_rows(q, parts, row_parts, hidden, kv_heads, out, first, last, new_keys, new_values,
               writes):  # pragma: no cover (compiled)
    """Rows ``first..last-1`` of a decode batch in one call.

    ``q`` (batch, heads, dim) scaled; ``parts`` (n, PART_COLUMNS) int64: the
    addresses of a part's flat keys and values, the floats between heads,
    and its length; row ``b``'s parts are lines ``row_parts[b]`` to
    ``row_parts[b + 1] - 1``, in order. ``hidden[b]``: the address of one
    byte per key (non-zero: hidden), or 0. ``out`` (batch, heads, v_dim).
    ``writes[b]`` non-zero: first copy ``new_keys[b]`` and ``new_values[b]``
    (kv_heads, dim) into the last position of the row's last part (the
    step's own position, claimed for this write).
    """
    heads, dim = q.shape[1], q.shape[2]
    v_dim = out.shape[2]
    repeats = heads // kv_heads
    nothing = np.zeros(1, dtype=np.uint8)
    for b in range(first, last):
        if writes[b]:
            own = parts[row_parts[b + 1] - 1]
            write_last(own[KEYS], own[K_STRIDE], own[LENGTH], new_keys[b])
            write_last(own[VALUES], own[V_STRIDE], own[LENGTH], new_values[b])
        total = 0
        for i in range(row_parts[b], row_parts[b + 1]):
            total += parts[i, LENGTH]
        scores = np.empty((kv_heads, repeats, total), dtype=np.float32)
        column = 0
        for i in range(row_parts[b], row_parts[b + 1]):
            length = parts[i, LENGTH]
            keys = numba.carray(floats_at(parts[i, KEYS]), ((kv_heads - 1) * parts[i, K_STRIDE] + length * dim,))
            part_scores(q[b], keys, parts[i, K_STRIDE], length, column, scores)
            column += length
        if hidden[b] != 0:
            softmax(scores, total, numba.carray(bytes_at(hidden[b]), (total,)), True)
        else:
            softmax(scores, total, nothing, False)
        column = 0
        for i in range(row_parts[b], row_parts[b + 1]):
            length = parts[i, LENGTH]
            values = numba.carray(floats_at(parts[i, VALUES]), ((kv_heads - 1) * parts[i, V_STRIDE] + length * v_dim,))
            part_values(scores, values, parts[i, V_STRIDE], length, column, out[b], i > row_parts[b])
            column += length
