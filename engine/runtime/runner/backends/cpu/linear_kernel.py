"""``x @ W.T`` for a few rows of ``x``, in one compiled pass over the weights (numba).

A decode step multiplies a handful of rows (one per agent) by every weight
matrix of the model, so its linear layers read the weights once and do
little arithmetic per byte: they are bound by memory bandwidth. BLAS's
``sgemm`` first copies ("packs") the weight matrix into its own layout,
which at a few rows costs more than the product. Over SmolLM2's 538 MB of
float32 weights on this project's 2-core x86 machines
(``bench/bench_linear_pass.py``), MLX's
matmul took 52.4 / 55.7 / 76.4 / 82.3 ms at 1 / 2 / 4 / 8 rows, this pass
21.5 / 23.8 / 28.7 / 40.9 ms (25 down to 13 GB/s), and both ~65 ms at 16.

Four weight rows at a time: each is read from memory once and multiplied
with every row of ``x`` (which stays in the CPU's cache). Rows of ``x`` go
four at a time too (16 sums in registers: a load of a weight row feeds
four multiply-adds, and so does a load of ``x``), the rest one at a time.
A speculative step's verification carries 8-64 rows (each agent's last
token and its drafts); over SmolLM2's weights (the 2-core x86 box)
four-by-four took 53 / 67 / 92 ms at 8 / 16 / 32 rows against 54 / 82 /
125 ms one row at a time and 109 / 109 / 141 ms through numpy's BLAS; at
64 rows BLAS is as fast (160 ms both). Output rows are split across threads
(``parallel``: numba's OpenMP layer, or its work queue where OpenMP is not
installed). Sums may be reassociated for SIMD (``fastmath`` reassoc and
contract only), as BLAS's blocked sums are; the real-model tests hold greedy
tokens to mlx-lm's.
"""

from __future__ import annotations

import numba
import numpy as np

_FAST = {"reassoc", "contract"}
# Weight rows per block; a thread's share of the output is a multiple of it.
_BLOCK = 4


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _four_by_four(xa, xb, xc, xd, w0, w1, w2, w3, out, m, j, inner):  # pragma: no cover (compiled)
    """``out[m + a, j + b]`` for four rows of ``x`` and four weight rows: 16 sums kept in registers."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = np.float32(0.0)
    for k in range(inner):
        u, v, t, r = xa[k], xb[k], xc[k], xd[k]
        p0, p1, p2, p3 = w0[k], w1[k], w2[k], w3[k]
        a0 += u * p0
        a1 += u * p1
        a2 += u * p2
        a3 += u * p3
        b0 += v * p0
        b1 += v * p1
        b2 += v * p2
        b3 += v * p3
        c0 += t * p0
        c1 += t * p1
        c2 += t * p2
        c3 += t * p3
        d0 += r * p0
        d1 += r * p1
        d2 += r * p2
        d3 += r * p3
    out[m, j], out[m, j + 1], out[m, j + 2], out[m, j + 3] = a0, a1, a2, a3
    out[m + 1, j], out[m + 1, j + 1], out[m + 1, j + 2], out[m + 1, j + 3] = b0, b1, b2, b3
    out[m + 2, j], out[m + 2, j + 1], out[m + 2, j + 2], out[m + 2, j + 3] = c0, c1, c2, c3
    out[m + 3, j], out[m + 3, j + 1], out[m + 3, j + 2], out[m + 3, j + 3] = d0, d1, d2, d3


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _rows(x, weights, out, start, end):  # pragma: no cover (compiled)
    """``out[:, j] = x @ weights[j]`` for ``start <= j < end``."""
    batch, inner = x.shape
    j = start
    while j + _BLOCK <= end:
        w0 = weights[j]
        w1 = weights[j + 1]
        w2 = weights[j + 2]
        w3 = weights[j + 3]
        m = 0
        while m + _BLOCK <= batch:
            _four_by_four(x[m], x[m + 1], x[m + 2], x[m + 3], w0, w1, w2, w3, out, m, j, inner)
            m += _BLOCK
        while m < batch:
            xm = x[m]
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for k in range(inner):
                v = xm[k]
                s0 += v * w0[k]
                s1 += v * w1[k]
                s2 += v * w2[k]
                s3 += v * w3[k]
            out[m, j] = s0
            out[m, j + 1] = s1
            out[m, j + 2] = s2
            out[m, j + 3] = s3
            m += 1
        j += _BLOCK
    while j < end:
        w0 = weights[j]
        for m in range(batch):
            xm = x[m]
            s0 = np.float32(0.0)
            for k in range(inner):
                s0 += xm[k] * w0[k]
            out[m, j] = s0
        j += 1


@numba.njit(nogil=True, fastmath=_FAST, parallel=True, cache=True)
def times_transposed(x, weights, out, shares):  # pragma: no cover (compiled)
    """``out = x @ weights.T``: ``x`` (rows, inner), ``weights`` (outputs, inner), both C-contiguous float32.

    ``shares``: how many parts the outputs are split into, one per thread.
    """
    outputs = weights.shape[0]
    step = (outputs + shares - 1) // shares
    step = (step + _BLOCK - 1) // _BLOCK * _BLOCK
    for p in numba.prange(shares):
        _rows(x, weights, out, min(outputs, p * step), min(outputs, (p + 1) * step))
