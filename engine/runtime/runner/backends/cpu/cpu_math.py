"""Softmax, attention, SiLU and GELU for MLX's CPU backend, built from its fast arithmetic.

MLX's CPU kernels evaluate ``exp`` and ``sigmoid`` at ~15 ns per float32
element on this project's x86 machines (numpy: ~1 ns), while a multiply or an
add costs under 1 ns (``bench/bench_forward_split.py``). A decode step takes
one ``exp`` per attention score and per SiLU input, so on the CPU its
attention grows with context mostly through ``exp``. Gemma's MLP takes a
``tanh`` per input (``nn.gelu_approx``), at ~33 ns per element: a 512-token
prefill chunk of Gemma 3 270M spent 0.87 s of its 18 layers in it.

:func:`exp` is MLX's own algorithm (``mlx/backend/cpu/simd/math.h``: a
degree-6 polynomial for ``2**f`` times ``2**n`` assembled from its bits)
written with MLX's elementwise arithmetic and compiled (a few fused kernels).
It agrees with ``mx.exp`` to 2 ulp (MLX rounds each step with ``fma``; this
evaluates the polynomial in another order) and takes ~3 ns per element.
:func:`attention` keeps the arithmetic of MLX's unfused CPU attention
(scaled queries, one softmax in float32 over all scores) with this softmax;
the real-model tests check that greedy outputs stay token-identical to
mlx-lm's, as batching (which also reorders float sums) does.

Each kernel is a pass over memory where MLX's softmax is one, so a long
prefill chunk's attention runs in blocks of queries small enough for the
CPU's caches. Only the CPU backend uses any of this (``host_attention.py``
for its caches' attention, its hooks for SiLU and GELU: ``backend.py``);
Metal and CUDA have fused kernels.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

_LOG2_E = 1.442695
# exp underflows to 0 below this (as mx.exp: 2**-126 is float32's smallest normal).
_MIN_EXPONENT = -126.0
_MAX_EXPONENT = 128.0
_OVERFLOW = 88.0 * _LOG2_E
# Adding then subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to
# the nearest integer with two additions; a compiled floor() calls libm per
# element (3.4 ns measured, as much as the rest of exp).
_ROUND = 12582912.0
# 2**f on [-0.5, 0.5], Horner coefficients highest first (MLX's).
_POLY = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3,
         5.550332471162809e-2, 2.402264791363012e-1, 6.931472028550421e-1, 1.0)

# Below this many elements MLX's one kernel beats this module's several
# (each costs ~5 us to launch; exp saves ~12 ns per element): decode at batch
# 1 and contexts under ~450 tokens keep MLX's SiLU and attention.
MIN_ELEMENTS = 4096
# Past this many scores in one attention call (heads x queries x keys), a
# prefill chunk's attention runs in blocks of queries (see attention()).
MAX_SCORES = 1 << 20
# Scores per block: ~2 MiB of float32, which the softmax's passes find in the
# CPU's caches (measured on 512-query chunks over 1K-16K keys: 1.3-1.9x
# MLX's fused softmax, where one pass over all the scores was slower than it).
BLOCK_SCORES = 1 << 19
MIN_BLOCK_QUERIES = 8


@mx.compile
def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``2**f`` (a polynomial), the bits of the float32 ``2**n``, and ``y = x * log2(e)``, clamped.

    The polynomial is evaluated in Estrin's form, not Horner's: MLX's compiler
    splits a deep chain of elementwise ops into separate kernels (passes over
    memory), and the shallower form measured ~1.7x faster.
    """
    y = mx.clip(x * _LOG2_E, _MIN_EXPONENT - 1.0, _MAX_EXPONENT)
    n = (y + _ROUND) - _ROUND
    f = y - n
    f2 = f * f
    c6, c5, c4, c3, c2, c1, c0 = _POLY
    p = (c0 + c1 * f) + f2 * (c2 + c3 * f) + (f2 * f2) * (c4 + c5 * f + c6 * f2)
    return p, mx.left_shift(n.astype(mx.int32) + 127, 23), y


@mx.compile
def _exp_join(p: mx.array, two_n: mx.array, y: mx.array) -> mx.array:
    # Above 88 mx.exp returns infinity (a little early: e**88.7 is still finite); so does this.
    return mx.where(y < _MIN_EXPONENT, 0.0, mx.where(y > _OVERFLOW, mx.inf, p * two_n))


def exp(x: mx.array) -> mx.array:
    """``e**x`` for float32 ``x``: MLX's polynomial, within 2 ulp of ``mx.exp``.

    As ``mx.exp``: infinity above 88; 0 below -87.3 (where ``mx.exp`` returns
    denormals, down to 0 at -88).

    Two compiled kernels around a bit cast (``view``), which a compiled graph
    cannot hold without being traced again for every new shape.
    """
    p, bits, y = _exp_parts(x)
    return _exp_join(p, bits.view(mx.float32), y)


@mx.compile
def _shifted(scores: mx.array) -> mx.array:
    return scores - mx.max(scores, axis=-1, keepdims=True)


@mx.compile
def _normalized(e: mx.array) -> mx.array:
    return e / mx.sum(e, axis=-1, keepdims=True)


def _softmax_f32(scores: mx.array) -> mx.array:
    return _normalized(exp(_shifted(scores)))


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, computed in float32 (``mx.softmax(..., precise=True)``)."""
    if scores.dtype == mx.float32:
        return _softmax_f32(scores)
    return _softmax_f32(scores.astype(mx.float32)).astype(scores.dtype)


@mx.compile
def _times_over(gate: mx.array, x: mx.array, e: mx.array) -> mx.array:
    return gate / (1.0 + e) * x


def _silu_times(gate: mx.array, x: mx.array) -> mx.array:
    return _times_over(gate, x, exp(-gate))


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` (mlx-lm's ``swiglu``), in float32 and back to the inputs' dtype."""
    if gate.dtype == mx.float32:
        return _silu_times(gate, x)
    return _silu_times(gate.astype(mx.float32), x.astype(mx.float32)).astype(gate.dtype)


_GELU_SCALE = math.sqrt(2 / math.pi)


@mx.compile
def _gelu_exponent(x: mx.array) -> mx.array:
    return (-2.0 * _GELU_SCALE) * (x + 0.044715 * x * x * x)


@mx.compile
def _gelu_join(x: mx.array, e: mx.array) -> mx.array:
    return x / (1.0 + e)


def gelu_approx(x: mx.array) -> mx.array:
    """``nn.gelu_approx``, in float32 and back to the input's dtype.

    ``0.5 x (1 + tanh(u))`` equals ``x * sigmoid(2u)``, and so ``x / (1 + exp(-2u))``:
    one ``exp`` from this module instead of MLX's ``tanh``. Where ``exp(-2u)``
    overflows (x below about -10) the result is -0, as MLX's is.
    """
    xf = x if x.dtype == mx.float32 else x.astype(mx.float32)
    out = _gelu_join(xf, exp(_gelu_exponent(xf)))
    return out if x.dtype == mx.float32 else out.astype(x.dtype)


@mx.compile
def _sigmoid_exponent(x: mx.array, slope: mx.array) -> mx.array:
    return -slope * x


def _times_sigmoid(x: mx.array, slope: float) -> mx.array:
    """``x * sigmoid(slope * x)`` as ``x / (1 + exp(-slope * x))``, in float32 and back to the input's dtype."""
    xf = x if x.dtype == mx.float32 else x.astype(mx.float32)
    out = _gelu_join(xf, exp(_sigmoid_exponent(xf, mx.array(slope, dtype=mx.float32))))
    return out if x.dtype == mx.float32 else out.astype(x.dtype)


def silu(x: mx.array) -> mx.array:
    """``nn.silu`` (``x * sigmoid(x)``): a vision tower's SwiGLU (Qwen2.5-VL's) calls it by that name."""
    return _times_sigmoid(x, 1.0)


def gelu_fast_approx(x: mx.array) -> mx.array:
    """``nn.gelu_fast_approx`` (``x * sigmoid(1.702 x)``, "QuickGELU": Qwen2-VL's tower)."""
    return _times_sigmoid(x, 1.702)


def geglu(gate: mx.array, x: mx.array) -> mx.array:
    """``gelu_approx(gate) * x`` (Gemma 4's ``geglu``)."""
    return gelu_approx(gate) * x


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None,
              evaluate_blocks: bool = True) -> mx.array:
    """Scaled dot-product attention as MLX's unfused CPU path computes it, with :func:`softmax`.

    ``queries`` (B, H, n, D); ``keys``/``values`` (B, KV, L, D) with H a
    multiple of KV (grouped queries share a key head without copying it);
    ``mask``: None, ``"causal"`` (the last ``n`` keys are the queries'
    positions) or an array broadcastable to (B, H, n, L), boolean (True
    attends) or additive.

    Under ``MIN_ELEMENTS`` scores MLX's own attention is used. A call with
    more than ``MAX_SCORES`` scores (a prefill chunk over a long context) runs
    in blocks of queries whose scores stay in the CPU's caches
    (``BLOCK_SCORES``), each evaluated before the next is built: the
    softmax's passes then read their cache, not memory. ``evaluate_blocks``
    False leaves the blocks in the model's graph (see ``host_attention.HostAttention``).
    """
    batch, q_heads, n, _ = queries.shape
    scores = batch * q_heads * n * keys.shape[2]
    if scores < MIN_ELEMENTS:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    if n > 1 and scores > MAX_SCORES:
        return _blocked(queries, keys, values, scale, mask, evaluate_blocks)
    return _attention(queries, keys, values, scale, mask)


def _blocked(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
             evaluate: bool) -> mx.array:
    batch, q_heads, n, _ = queries.shape
    length = keys.shape[2]
    block = max(MIN_BLOCK_QUERIES, BLOCK_SCORES // (batch * q_heads * length))
    outputs = []
    for start in range(0, n, block):
        end = min(n, start + block)
        if isinstance(mask, str) or mask is None:
            # Causal: this block's queries see the keys up to the last one's position.
            visible = length - n + end if mask is not None else length
            out = _attention(queries[:, :, start:end], keys[:, :, :visible], values[:, :, :visible], scale, mask)
        else:
            out = _attention(queries[:, :, start:end], keys, values, scale, mask_rows(mask, start, end))
        if evaluate:
            mx.eval(out)
        outputs.append(out)
    return mx.concatenate(outputs, axis=2)


def mask_rows(mask: mx.array, start: int, end: int) -> mx.array:
    """The query rows ``[start, end)`` of a (.., n, L) mask (a mask with one row applies to all)."""
    return mask if mask.ndim < 2 or mask.shape[-2] == 1 else mask[..., start:end, :]


def _attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    batch, q_heads, n, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    repeats = q_heads // kv_heads
    q = (queries * mx.array(scale, dtype=queries.dtype)).reshape(batch, kv_heads, repeats * n, dim)
    scores = q @ keys.swapaxes(-1, -2)
    if mask is not None:
        scores = scores.reshape(batch, kv_heads, repeats, n, length)
        scores = apply_mask(scores, mask, n, length)
        scores = scores.reshape(batch, kv_heads, repeats * n, length)
    out = softmax(scores) @ values
    return out.reshape(batch, q_heads, n, values.shape[-1])


def apply_mask(scores: mx.array, mask: Any, n: int, length: int) -> mx.array:
    """``scores`` (B, KV, R, n, L); a (.., H, n, L) mask is split into (KV, R) to match."""
    if isinstance(mask, str):
        if n == 1:
            return scores  # one query at the last position sees every key
        rows = mx.arange(length - n, length)[:, None]
        mask = rows >= mx.arange(length)[None, :]
    if mask.ndim >= 3 and mask.shape[-3] > 1:
        heads = mask.shape[-3]
        kv_heads = scores.shape[1]
        mask = mask.reshape(*mask.shape[:-3], kv_heads, heads // kv_heads, *mask.shape[-2:])
    elif mask.ndim >= 3:
        mask = mx.expand_dims(mask, -3)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask.astype(scores.dtype)
