"""``x @ W.T`` for a few rows of ``x``, in one compiled pass over the weights that fetches ahead of itself.

A decode step multiplies a handful of rows (one per agent, or an agent's
token and its drafts) by every weight matrix of the model. Each weight row is
read from memory once and multiplied with every row of ``x`` (which stays in
the CPU's cache), four weight rows by up to four rows of ``x`` at a time: 16
sums in vector registers, so a load of a weight vector feeds four
multiply-adds and so does a load of ``x``. BLAS's ``sgemm`` first copies
("packs") the weights into its own layout, which at a few rows costs more
than the product.

What bounds it is memory, and not its bandwidth alone: on this project's
2-core x86 boxes a core keeps only so many cache misses in flight, so reading
the weights and multiplying them do not overlap unless the pass asks for the
next weights before it needs them. With 16 rows a block of four weight rows
is multiplied in four passes; the first waited on memory and the other three
computed with nothing fetched meanwhile (measured: the time with the weights
out of the cache was the time with them in it plus the time to read them).
So every pass here prefetches its share of the next block's rows
(``llvm.prefetch``, a hint that never faults): over SmolLM2's 538 MB of
float32 weights on a 2-core Sapphire Rapids box, 4 / 8 / 16 / 32 rows took
28.8 / 28.8 / 36.0 / 55.6 ms against 38.5 / 43.0 / 56.0 / 75.9 ms without it
(``bench/bench_linear_pass.py`` keeps the current figures).

numba's loops cannot hold a prefetch (LLVM then does not vectorize them), so
the block's inner loop is written as LLVM IR (``_block``): vectors of eight
floats, ``llvm.fma``, one prefetch per prefetched row an iteration, and the
sums reduced once at the end. Sums are reassociated across the eight lanes,
as BLAS's blocked sums are; the real-model tests hold greedy tokens to
mlx-lm's. Output rows are split across threads (``parallel``: numba's OpenMP
layer, or its work queue where OpenMP is not installed).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_FAST = {"reassoc", "contract"}
# Weight rows per block (and rows of ``x`` per pass); a thread's share of the output is a multiple of it.
_BLOCK = 4
# Floats a vector holds (256 bits: AVX2, AVX-512 and two NEON registers all take it).
_LANES = 8
# How far ahead the passes fetch: the next block.
_AHEAD = _BLOCK

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_BYTES = ir.IntType(8).as_pointer()
_VECTOR = ir.VectorType(_F32, _LANES)


# Every block shape a pass runs: (rows of ``x``, weight rows fetched meanwhile). Four rows of ``x`` or the last one
# to three, fetching one, two or four rows; a lone row of ``x`` fetches none.
_SHAPES = tuple((rows, fetched) for rows in (1, 2, 3, 4) for fetched in (1, 2, 4)) + ((1, 0),)


@intrinsic
def _block(typingctx, x, weights, out, m, j, fetch_row, rows, fetched_rows):
    """``_block(x, weights, out, m, j, fetch_row, rows, fetched_rows)``: ``out[m + a, j + b]`` for ``a < rows``
    and ``b < 4``, the sums over the first ``inner // 8 * 8`` columns; meanwhile the ``fetched_rows`` weight rows
    from ``fetch_row`` on are prefetched, spread over the loop. One loop is emitted per shape in ``_SHAPES`` and
    the call switches to its own (a shape outside them does nothing)."""
    signature = types.void(x, weights, out, m, j, fetch_row, rows, fetched_rows)

    def codegen(context, builder, sig, args):
        x_type, w_type, out_type = sig.args[:3]
        arrays = (context.make_array(x_type)(context, builder, args[0]),
                  context.make_array(w_type)(context, builder, args[1]),
                  context.make_array(out_type)(context, builder, args[2]))
        rows_, fetched_ = (context.cast(builder, v, t, types.int64) for v, t in zip(args[6:], sig.args[6:]))
        shape = builder.add(builder.mul(rows_, _I64(8)), fetched_)
        done = builder.append_basic_block("block.done")
        switch = builder.switch(shape, done)
        for rows, fetched in _SHAPES:
            case = builder.append_basic_block(f"block.{rows}x{fetched}")
            switch.add_case(_I64(rows * 8 + fetched), case)
            builder.position_at_end(case)
            _emit_block(context, builder, sig.args[:3], arrays, args[3:6], rows, fetched)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return signature, codegen


def _emit_block(context, builder, array_types, arrays, at, rows: int, fetched_rows: int) -> None:
    """The IR of one block shape (see :func:`_block`): vectors of eight floats, ``rows`` x 4 sums."""
    x_type, w_type, out_type = array_types
    xs, ws, outs = arrays
    m_, j_, fetch = at
    zero = context.get_constant(types.intp, 0)

    def row(array, array_type, index):
        return cgutils.get_item_pointer(context, builder, array_type, array, [index, zero], wraparound=False)

    x_rows = [row(xs, x_type, builder.add(m_, _I64(a))) for a in range(rows)]
    w_rows = [row(ws, w_type, builder.add(j_, _I64(b))) for b in range(_BLOCK)]
    ahead = builder.bitcast(row(ws, w_type, fetch), _BYTES)
    module = builder.module
    fma = cgutils.get_or_insert_function(module, ir.FunctionType(_VECTOR, [_VECTOR] * 3), "llvm.fma.v8f32")
    prefetch = cgutils.get_or_insert_function(
        module, ir.FunctionType(ir.VoidType(), [_BYTES, _I32, _I32, _I32]), "llvm.prefetch.p0")
    add_up = cgutils.get_or_insert_function(
        module, ir.FunctionType(_F32, [_F32, _VECTOR]), "llvm.vector.reduce.fadd.v8f32")
    sums = [cgutils.alloca_once_value(builder, ir.Constant(_VECTOR, [0.0] * _LANES)) for _ in range(rows * _BLOCK)]
    inner = builder.extract_value(xs.shape, 1)
    with cgutils.for_range(builder, builder.udiv(inner, _I64(_LANES))) as loop:
        k = builder.mul(loop.index, _I64(_LANES))
        # Each iteration reads 32 bytes of a weight row: fetching 32 bytes of each fetched row keeps pace.
        fetched = builder.mul(loop.index, _I64(32 * fetched_rows))
        for r in range(fetched_rows):
            # (address, write: no, locality: keep in every cache level, data)
            builder.call(prefetch, [builder.gep(ahead, [builder.add(fetched, _I64(32 * r))]), _I32(0), _I32(3), _I32(1)])
        xv = [builder.load(builder.bitcast(builder.gep(p, [k]), _VECTOR.as_pointer()), align=4) for p in x_rows]
        wv = [builder.load(builder.bitcast(builder.gep(p, [k]), _VECTOR.as_pointer()), align=4) for p in w_rows]
        for a in range(rows):
            for b in range(_BLOCK):
                total = sums[a * _BLOCK + b]
                builder.store(builder.call(fma, [xv[a], wv[b], builder.load(total)]), total)
    for a in range(rows):
        for b in range(_BLOCK):
            value = builder.call(add_up, [ir.Constant(_F32, 0.0), builder.load(sums[a * _BLOCK + b])],
                                 fastmath=("reassoc",))
            at_out = cgutils.get_item_pointer(context, builder, out_type, outs,
                                              [builder.add(m_, _I64(a)), builder.add(j_, _I64(b))], wraparound=False)
            builder.store(value, at_out)


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _pass(x, weights, out, m, j, rows, fetched_rows, fetch_row):  # pragma: no cover (compiled)
    """One pass: ``rows`` (1-4) rows of ``x`` from ``m`` by the weight block at ``j``, fetching ``fetched_rows``."""
    _block(x, weights, out, m, j, fetch_row, rows, fetched_rows)
    # The columns past the last whole vector (an inner size not a multiple of eight: tiny test models).
    inner = x.shape[1]
    for k in range(inner - inner % _LANES, inner):
        for a in range(rows):
            v = x[m + a, k]
            for b in range(_BLOCK):
                out[m + a, j + b] += v * weights[j + b, k]


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _rows(x, weights, out, start, end):  # pragma: no cover (compiled)
    """``out[:, j] = x @ weights[j]`` for ``start <= j < end``."""
    batch, inner = x.shape
    passes = (batch + _BLOCK - 1) // _BLOCK
    # The next block's four rows shared out over the passes: one each from four passes on, else two or four.
    # One row of ``x`` fetches nothing: one pass reads the weights steadily enough for the CPU's own prefetcher
    # (fetching too took 3-6% longer).
    fetched_rows = 1 if passes >= 4 else (2 if passes >= 2 else (4 if batch > 1 else 0))
    last = weights.shape[0] - fetched_rows  # a fetch stays inside the weights
    j = start
    while j + _BLOCK <= end:
        for p in range(passes):
            m = p * _BLOCK
            ahead = min(last, j + _AHEAD + (p * fetched_rows) % _BLOCK)
            _pass(x, weights, out, m, j, min(_BLOCK, batch - m), fetched_rows, max(0, ahead))
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
