"""Attention weights for a long prefill chunk: one compiled pass per row of scores, rows across threads (numba).

MLX's CPU softmax runs on one thread at ~15 ns a score (its ``exp``, then a
pass over memory per reduction); ``cpu_math.softmax`` brings that to ~10.
A 466-token chunk over 20K keys with 8 query heads has 77M scores a layer,
and its softmax took 1.1-1.3 s of the call's 1.5 s (the two products
through BLAS: 0.35 s). Here each row (one query's scores, ~80 KB at 20K
keys) stays in the CPU's cache for its three passes: the maximum, ``exp``,
the scaling. ~0.9 ns a score on this project's 2-core x86 machines.

``exp`` is MLX's own algorithm (as ``cpu_math.exp``: the degree-6
polynomial for ``2**f``, times ``2**n`` assembled from its bits), so the
weights agree with ``mx.softmax(..., precise=True)`` to a few ulp. Only
``contract`` (fused multiply-add) is allowed: ``reassoc`` would fold the
rounding trick ``(y + 1.5 * 2**23) - 1.5 * 2**23`` into ``y`` (measured: 1e-5
off instead of 1e-13), so the row's total is summed in order. Keys past a row's ``visible`` count (a causal
chunk's future positions) get weight 0 without being read.
"""

from __future__ import annotations

import numba
import numpy as np

_LOG2_E = np.float32(1.442695)
_MIN_EXPONENT = np.float32(-126.0)  # below it exp is 0 (2**-126: float32's smallest normal), as cpu_math.exp
_ROUND = np.float32(12582912.0)  # 1.5 * 2**23: adding then subtracting it rounds to the nearest integer
_C6, _C5, _C4, _C3, _C2, _C1, _C0 = (np.float32(c) for c in (
    1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3,
    5.550332471162809e-2, 2.402264791363012e-1, 6.931472028550421e-1, 1.0))


@numba.njit(nogil=True, fastmath={"contract"}, cache=True)
def _softmax_row(x, n):  # pragma: no cover (compiled)
    """``x``'s first ``n`` scores become their softmax, the rest 0, in place."""
    length = x.shape[0]
    n = min(n, length)
    for j in range(max(n, 0), length):
        x[j] = np.float32(0.0)
    if n <= 0:
        return
    top = x[0]
    for j in range(1, n):
        top = max(top, x[j])
    # 2**n's bits go to a scratch row, read back as floats (a bit cast numba vectorizes).
    bits = np.empty(n, np.int32)
    powers = bits.view(np.float32)
    for j in range(n):
        y = max((x[j] - top) * _LOG2_E, _MIN_EXPONENT - np.float32(1.0))
        whole = (y + _ROUND) - _ROUND
        f = y - whole
        p = ((((((_C6 * f + _C5) * f + _C4) * f + _C3) * f + _C2) * f + _C1) * f + _C0)
        bits[j] = (np.int32(whole) + 127) << 23
        x[j] = p if y >= _MIN_EXPONENT else np.float32(0.0)
    total = np.float32(0.0)
    for j in range(n):
        x[j] *= powers[j]
        total += x[j]
    scale = np.float32(1.0) / total
    for j in range(n):
        x[j] *= scale


@numba.njit(nogil=True, fastmath={"contract"}, parallel=True, cache=True)
def softmax_rows(scores, visible):  # pragma: no cover (compiled)
    """Replace each row of ``scores`` (R, L; float32, C-contiguous) by its softmax, in place.

    ``visible`` (R,; int64): row ``r`` takes its first ``visible[r]`` scores;
    the rest become 0. A row's scores are all finite (masked keys carry
    float32's lowest value, as ``cpu_math`` masks them).
    """
    for r in numba.prange(scores.shape[0]):
        _softmax_row(scores[r], visible[r])


@numba.njit(nogil=True, fastmath={"contract"}, cache=True)
def softmax_rows_here(scores, visible):  # pragma: no cover (compiled)
    """:func:`softmax_rows` on the calling thread alone: for a few rows (a verification's queries), where
    starting the parallel loop's threads costs more than the rows (~7 ms against ~0.2)."""
    for r in range(scores.shape[0]):
        _softmax_row(scores[r], visible[r])
