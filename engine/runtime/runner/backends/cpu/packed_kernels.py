"""Compiled loops (numba) for a decode batch's attention over K/V the hot pool holds packed (``--kv-bits``).

A packed K or V is ``mx.quantize``'s affine packing along the head dimension
(``kv/quantized_kv.py``): ``bits`` a value in little-endian words (8 bits:
a byte a value; 4: two a byte, the low nibble first) and a scale and a bias
per ``group`` values, each of the three arrays laid out (1, kv_heads,
capacity, width). :func:`batch_rows_packed` is ``host_kernels.batch_rows``
over such parts: each position's key or value is unpacked into a row of
floats (``scale * w + bias``, what MLX's quantized products multiply by)
just before the head's queries use it, so a step reads a quarter (8 bits)
or an eighth (4) of the bytes float32 K/V take, and the scores, the softmax
and the weighted sum are ``batch_rows``' arithmetic.

The step's own key and value are packed here (:func:`pack_last`) as MLX's
CPU ``mx.quantize`` packs them, step for step in float32 (the group's min
and max, a scale that puts the edge further from zero on a whole bin, round
half to even), so a position written by these loops holds the very words,
scales and biases a position written through MLX holds (tested bit for bit).
"""

from __future__ import annotations

import numba
import numpy as np

from engine.runtime.runner.backends.cpu.host_kernels import bytes_at, floats_at, softmax

_FAST = {"reassoc", "contract"}  # (as host_kernels': sums reassociated for SIMD, exp and infinities kept)

# Columns of the ``parts`` table batch_rows_packed reads, one part per line: the addresses of the keys' bytes,
# scales and biases and the values' (each packing's three in that order: ``_packing``), the part's capacity
# (positions its arrays hold) and its length.
K_WORDS, K_SCALES, K_BIASES, V_WORDS, V_SCALES, V_BIASES, CAPACITY, LENGTH = range(8)
PACKED_COLUMNS = 8


@numba.njit(nogil=True, fastmath=_FAST, cache=True, inline="always")
def unpack_into(words, scales, biases, at, dim, bits, group, out):  # pragma: no cover (compiled)
    """``out[:dim]`` = position ``at`` (counted over heads x capacity) of a packed K or V, unpacked."""
    row_bytes = dim * bits // 8
    groups = dim // group
    first_byte = at * row_bytes
    first_group = at * groups
    # (slices: indices the compiler knows are in range, so the loops vectorize)
    for g in range(groups):
        s = scales[first_group + g]
        b = biases[first_group + g]
        into = out[g * group:(g + 1) * group]
        if bits == 8:
            w = words[first_byte + g * group:first_byte + (g + 1) * group]
            for d in range(group):
                into[d] = s * np.float32(w[d]) + b
        else:
            w = words[first_byte + g * group // 2:first_byte + (g + 1) * group // 2]
            for j in range(group // 2):
                into[2 * j] = s * np.float32(w[j] & 15) + b
                into[2 * j + 1] = s * np.float32(w[j] >> 4) + b


@numba.njit(nogil=True, cache=True)
def pack_last(words, scales, biases, capacity, length, new, bits, group):  # pragma: no cover (compiled)
    """Pack ``new`` (kv_heads, dim) into position ``length - 1`` of each head, as MLX's CPU quantize does.

    No fastmath here: every step is MLX's float32 operation, so the result is its bits."""
    kv_heads, dim = new.shape
    n_bins = np.float32((1 << bits) - 1)
    eps = np.float32(1e-7)
    zero = np.float32(0.0)
    per_byte = 8 // bits
    row_bytes = dim * bits // 8
    groups = dim // group
    for h in range(kv_heads):
        at = h * capacity + length - 1
        for g in range(groups):
            lo = np.float32(np.inf)
            hi = np.float32(-np.inf)
            for d in range(g * group, (g + 1) * group):
                hi = max(hi, new[h, d])
                lo = min(lo, new[h, d])
            low_edge = abs(lo) > abs(hi)
            scale = max((hi - lo) / n_bins, eps)
            if not low_edge:
                scale = -scale
            edge = lo if low_edge else hi
            q0 = np.float32(np.rint(edge / scale))
            bias = zero
            if q0 != zero:
                scale = np.float32(edge / q0)
                bias = edge
            first = at * row_bytes + g * group // per_byte
            for j in range(group // per_byte):
                byte = 0
                for k in range(per_byte):
                    w = np.float32(np.rint((new[h, g * group + j * per_byte + k] - bias) / scale))
                    w = min(max(w, zero), n_bins)
                    byte |= int(w) << (k * bits)
                words[first + j] = byte
            scales[at * groups + g] = scale
            biases[at * groups + g] = bias


@numba.njit(nogil=True, cache=True)
def pack_positions(words, scales, biases, capacity, first, new, bits, group):  # pragma: no cover (compiled)
    """Pack ``new`` (tokens, kv_heads, dim) into positions ``first``, ``first + 1``, ... of each head."""
    for t in range(new.shape[0]):
        pack_last(words, scales, biases, capacity, first + t + 1, new[t], bits, group)


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def unpack_positions(words, scales, biases, capacity, bits, group, out):  # pragma: no cover (compiled)
    """``out`` (kv_heads, length, width) = the first ``length`` positions of a packed K or V, unpacked."""
    kv_heads, length, width = out.shape
    for h in range(kv_heads):
        for p in range(length):
            unpack_into(words, scales, biases, h * capacity + p, width, bits, group, out[h, p])


@numba.njit(nogil=True, cache=True)
def _packing(part, words_col, kv_heads, width, bits, group):  # pragma: no cover (compiled)
    """One packed K or V of a part (``words_col``: K_WORDS or V_WORDS; its scales and biases follow): its words
    as bytes, its scales and its biases, each over every head's capacity."""
    capacity = part[CAPACITY]
    groups = kv_heads * capacity * (width // group)
    return (numba.carray(bytes_at(part[words_col]), (kv_heads * capacity * (width * bits // 8),)),
            numba.carray(floats_at(part[words_col + 1]), (groups,)),
            numba.carray(floats_at(part[words_col + 2]), (groups,)))


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def packed_scores(q, part, column, scores, bits, group, key):  # pragma: no cover (compiled)
    """``scores[h, r, column + p]`` = query ``h * repeats + r`` . key ``p`` of head ``h`` of a packed part."""
    kv_heads, repeats, _ = scores.shape
    dim = q.shape[1]
    capacity, length = part[CAPACITY], part[LENGTH]
    words, scales, biases = _packing(part, K_WORDS, kv_heads, dim, bits, group)
    for h in range(kv_heads):
        for p in range(length):
            unpack_into(words, scales, biases, h * capacity + p, dim, bits, group, key)
            for r in range(repeats):
                qr = q[h * repeats + r]
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += qr[d] * key[d]
                scores[h, r, column + p] = acc


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def packed_values(scores, part, column, out, accumulate, bits, group, value):  # pragma: no cover (compiled)
    """``out[h * repeats + r]`` (+)= the weights from ``column`` on times the packed part's values of head ``h``."""
    kv_heads, repeats, _ = scores.shape
    v_dim = out.shape[1]
    capacity, length = part[CAPACITY], part[LENGTH]
    words, scales, biases = _packing(part, V_WORDS, kv_heads, v_dim, bits, group)
    for h in range(kv_heads):
        if not accumulate:
            for r in range(repeats):
                out[h * repeats + r, :] = 0.0
        for p in range(length):
            unpack_into(words, scales, biases, h * capacity + p, v_dim, bits, group, value)
            for r in range(repeats):
                w = scores[h, r, column + p]
                row = out[h * repeats + r]
                for d in range(v_dim):
                    row[d] += w * value[d]


@numba.njit(nogil=True, cache=True)
def _pack_into_part(part, words_col, new, bits, group):  # pragma: no cover (compiled)
    kv_heads, width = new.shape
    words, scales, biases = _packing(part, words_col, kv_heads, width, bits, group)
    pack_last(words, scales, biases, part[CAPACITY], part[LENGTH], new, bits, group)


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def batch_rows_packed(q, parts, row_parts, hidden, kv_heads, out, first, last, new_keys, new_values, writes,
                      bits, group):  # pragma: no cover (compiled)
    """``host_kernels.batch_rows`` over packed parts (``parts``: (n, PACKED_COLUMNS) int64).

    ``writes[b]`` non-zero: first pack ``new_keys[b]`` and ``new_values[b]`` (kv_heads, dim) into the last
    position of the row's last part."""
    heads, dim = q.shape[1], q.shape[2]
    v_dim = out.shape[2]
    repeats = heads // kv_heads
    nothing = np.zeros(1, dtype=np.uint8)
    key = np.empty(dim, dtype=np.float32)
    value = np.empty(v_dim, dtype=np.float32)
    for b in range(first, last):
        if writes[b]:
            own = parts[row_parts[b + 1] - 1]
            _pack_into_part(own, K_WORDS, new_keys[b], bits, group)
            _pack_into_part(own, V_WORDS, new_values[b], bits, group)
        total = 0
        for i in range(row_parts[b], row_parts[b + 1]):
            total += parts[i, LENGTH]
        scores = np.empty((kv_heads, repeats, total), dtype=np.float32)
        column = 0
        for i in range(row_parts[b], row_parts[b + 1]):
            packed_scores(q[b], parts[i], column, scores, bits, group, key)
            column += parts[i, LENGTH]
        if hidden[b] != 0:
            softmax(scores, total, numba.carray(bytes_at(hidden[b]), (total,)), True)
        else:
            softmax(scores, total, nothing, False)
        column = 0
        for i in range(row_parts[b], row_parts[b + 1]):
            packed_values(scores, parts[i], column, out[b], i > row_parts[b], bits, group, value)
            column += parts[i, LENGTH]

