"""A Llama-family decode step on the CPU in numpy and compiled loops, with no MLX operation inside the model.

On this project's 2-core x86 machines each ``mx.eval`` is a hand-off to
MLX's CPU stream thread (28-90 us before any arithmetic,
``bench/bench_linear_pass.py``), and MLX's ``sgemm`` reads a decode step's
weights at half the rate a few-row pass can (``linear_kernel.py``). A decode
step that hands its linear layers and attention to compiled loops inside
MLX's forward must evaluate the graph four or five times a layer, and its
small MLX operations between them cost more than their arithmetic. This runs
the whole step on the host instead (SmolLM2, one agent: 25.3 against 14.7
tok/s through MLX's forward, ``bench/bench_step_profile.py``): the token embeddings, RMS norms, projections
(``linear_kernel`` up to ``host_linear.HOST_STEP_MAX_ROWS`` rows, BLAS's ``sgemm``
through numpy above), rotary embeddings, attention over each row's cache
where it lies (``host_decode.attend_host``, which also writes the step's key
and value in place; ``host_packed_decode`` where the hot pool packs K/V), SwiGLU and the output layer, and hands MLX the logits.

Only where every part is known: mlx-lm's ``llama`` models (Llama, SmolLM2,
and the families mlx-lm loads as ``llama``) with full attention in every
layer, ``nn.RoPE`` rotations, float32 weights in plain ``nn.Linear``
layers; a batch whose every row may be written in place (``HostFullKV.can_claim``:
not after a rewind). The CPU backend decides that (``backend.py``). Everything else (Gemma's sliding windows, quantized
weights, long prefill passes) runs through MLX's forward; a prompt chunk that rides a decode
step (``prompt_rows`` below) runs here with it, and so does a short prefill pass of chunks alone (no decode
rows: no logits).

Numerics: the rotations' cosines and sines come from ``mx.fast.rope`` itself
(a table per position, so they are bit-identical to MLX's); the rest is
float32 arithmetic in MLX's order up to reassociated sums, as batching and
BLAS already do. The real-model tests hold greedy tokens to mlx-lm's.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from functools import partial
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.runtime.runner.backends.cpu import host_decode, host_linear, host_packed_decode, host_verify_attention
from engine.runtime.runner.backends.cpu.host_decode import host_parts
from engine.runtime.runner.kv.quantized_kv import QuantizedFullKV

# Rotation tables grow by this many positions at a time.
_TABLE_STEP = 4096


@dataclass(frozen=True, slots=True)
class _Rope:
    dims: int
    traditional: bool
    base: float
    scale: float


class RopeTables:
    """Cosines and sines of ``mx.fast.rope`` per position, read off MLX's own rotation of a basis."""

    def __init__(self) -> None:
        self._tables: dict[_Rope, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def at(self, rope: _Rope, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin), each (len(positions), dims / 2) float32."""
        with self._lock:
            cos, sin = self._tables.get(rope, (None, None))
            if cos is None or int(positions.max()) >= cos.shape[0]:
                length = (int(positions.max()) // _TABLE_STEP + 1) * _TABLE_STEP
                cos, sin = _rope_table(rope, length)
                self._tables[rope] = (cos, sin)
        return cos[positions], sin[positions]


def _rope_table(rope: _Rope, length: int) -> tuple[np.ndarray, np.ndarray]:
    half = rope.dims // 2
    if rope.traditional:  # pairs (2i, 2i + 1): rotate (1, 0) in each
        basis = mx.broadcast_to(mx.array([1.0, 0.0] * half, dtype=mx.float32), (1, 1, length, rope.dims))
    else:  # pairs (i, i + half): rotate (1, 0) in each
        basis = mx.concatenate([mx.ones((1, 1, length, half)), mx.zeros((1, 1, length, half))], axis=-1)
    turned = np.array(mx.fast.rope(basis, rope.dims, traditional=rope.traditional, base=rope.base,
                                   scale=rope.scale, offset=0))[0, 0]
    if rope.traditional:
        return np.ascontiguousarray(turned[:, 0::2]), np.ascontiguousarray(turned[:, 1::2])
    return np.ascontiguousarray(turned[:, :half]), np.ascontiguousarray(turned[:, half:])


def supports(model: Any) -> bool:
    """Whether :func:`decode` knows every part of ``model`` (see the module's docstring)."""
    if type(model).__module__ != "mlx_lm.models.llama":
        return False
    args = model.args
    if any(t != "full_attention" for t in (args.layer_types or ())):
        return False
    linears = [getattr(layer.self_attn, n) for layer in model.model.layers for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(layer.mlp, n) for layer in model.model.layers for n in ("gate_proj", "up_proj", "down_proj")]
    if not args.tie_word_embeddings:
        linears.append(model.lm_head)
    norms = [n for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    embed = model.model.embed_tokens
    return (all(_plain(m, nn.Linear, host_linear.HostLinear) and m.weight.dtype == mx.float32 for m in linears)
            and _plain(embed, nn.Embedding, host_linear.HostEmbedding) and embed.weight.dtype == mx.float32
            and all(type(n) is nn.RMSNorm for n in [*norms, model.model.norm])
            and all(type(layer.self_attn.rope) is nn.RoPE for layer in model.model.layers))


def _plain(module: Any, mlx_class: type, host_class: type) -> bool:
    """An MLX layer of exactly ``mlx_class`` (no LoRA or quantized subclass), or the host pass's own."""
    return type(module) is mlx_class or isinstance(module, host_class)


def decode(model: Any, inputs: mx.array, rows: Sequence[Any], tables: RopeTables, workers: Executor | None = None,
           linear_pass: bool = True, widths: Sequence[int] | None = None, prompt_rows: int = 0) -> mx.array:
    """The logits (batch, vocabulary) of one decode step: row ``b`` feeds ``inputs[b]`` to cache ``rows[b]``.

    Each layer's cache takes the step's position as ``model(inputs[:, None], cache)`` would (its offset
    moves by one); :func:`supports` must hold for ``model`` and every row's layers must be claimable.
    ``tables``: the rotations (kept by the caller across steps); ``workers``: threads for the attention
    loops; ``linear_pass``: products of few rows through ``linear_kernel`` (else BLAS).

    ``widths`` (a speculative step's verification): row ``b`` feeds ``widths[b]`` consecutive tokens of the
    flat ``inputs`` (its last token and its drafts) and gets a logits row for each, as a causal forward
    over them would: each token is a row of its own in the linear layers, so the pass reads the weights once
    for every token of the step, and a sequence's tokens attend together, each to the row's cache up to and
    including itself (``host_verify_attention``).

    ``prompt_rows``: the last ``prompt_rows`` of ``rows`` feed a chunk of their prompt (``widths`` each) and only
    write their caches: no logits for their tokens (a prompt chunk riding a decode step, see
    ``CpuBackend.carries_prompts``). The logits returned are the other rows' tokens'.
    """
    widths = [1] * len(rows) if widths is None else list(widths)
    mx.eval(inputs, [(p[0], p[1]) for kv in rows for layer in kv.layers for p in host_parts(layer, 0)])
    tokens = np.asarray(inputs).reshape(-1).astype(np.int64)
    body = model.model
    h = np.asarray(body.embed_tokens.weight)[tokens]
    first = body.layers[0].self_attn
    heads, kv_heads = first.n_heads, first.n_kv_heads
    rope = first.rope
    positions = [kv.layers[0].offset + j for kv, w in zip(rows, widths) for j in range(w)]
    cos, sin = tables.at(_Rope(rope.dims, rope.traditional, rope.base, rope.scale),
                          np.array(positions, dtype=np.int64))
    batch = len(positions)
    groups = _Groups(widths)
    for i, layer in enumerate(body.layers):
        attn = layer.self_attn
        x = _rms_norm(h, layer.input_layernorm)
        q = _linear(x, attn.q_proj, linear_pass).reshape(batch, heads, -1)
        k = _linear(x, attn.k_proj, linear_pass).reshape(batch, kv_heads, -1)
        v = _linear(x, attn.v_proj, linear_pass).reshape(batch, kv_heads, -1)
        q = _rotate(q, cos, sin, rope)
        k = _rotate(k, cos, sin, rope)
        claimed = [kv.layers[i].claim_one() for kv, w in zip(rows, widths) for _ in range(w)]
        layers = [kv.layers[i] for kv, w in zip(rows, widths) for _ in range(w)]
        parts = [host_parts(layer, at + 1) for layer, at in zip(layers, claimed)]
        out = groups.attend(q * np.float32(attn.scale), parts, k, v, claimed, workers, _packing(layers[0]))
        h = h + _linear(out.reshape(batch, -1), attn.o_proj, linear_pass)
        mlp = layer.mlp
        x = _rms_norm(h, layer.post_attention_layernorm)
        gate, up = _linear(x, mlp.gate_proj, linear_pass), _linear(x, mlp.up_proj, linear_pass)
        h = h + _linear(_swiglu(gate, up), mlp.down_proj, linear_pass)
    head = body.embed_tokens.weight if model.args.tie_word_embeddings else model.lm_head.weight
    if prompt_rows:
        h = h[:batch - sum(widths[len(widths) - prompt_rows:])]
        if not len(h):  # a prefill pass of prompt chunks alone: no logits
            return mx.zeros((0, head.shape[0]), dtype=mx.float32)
    x = _rms_norm(h, body.norm)
    return mx.array(_times(x, np.asarray(head), linear_pass))


class _Groups:
    """A step's rows by how they attend: a sequence feeding one token through ``host_decode``'s loops, one feeding
    several (drafts, a prompt chunk) with its tokens together through BLAS (``host_verify_attention``)."""

    def __init__(self, widths: Sequence[int]) -> None:
        self.widths = list(widths)
        starts = np.cumsum([0, *widths])
        self.single = [int(starts[g]) for g, w in enumerate(widths) if w == 1]
        self.wide = [(int(starts[g]), w) for g, w in enumerate(widths) if w > 1]

    def attend(self, scaled: np.ndarray, parts: Sequence[Sequence[Any]], keys: np.ndarray, values: np.ndarray,
               claimed: Sequence[int], workers: Executor | None, packing: tuple[int, int] | None) -> np.ndarray:
        if packing is None:
            singles, groups = host_decode.attend_host, host_verify_attention.attend_groups
        else:  # (K/V the hot pool packs)
            singles = partial(host_packed_decode.attend_host, bits=packing[0], group=packing[1])
            groups = partial(host_packed_decode.attend_groups, bits=packing[0], group=packing[1])
        if not self.wide:
            return singles(scaled, parts, keys, values, claimed, workers=workers)
        if not self.single:
            return groups(scaled, parts, keys, values, claimed, self.widths, workers=workers)
        out = np.empty((scaled.shape[0], scaled.shape[1], values.shape[-1]), dtype=np.float32)
        one = self.single
        out[one] = singles(scaled[one], [parts[r] for r in one], keys[one], values[one], [claimed[r] for r in one],
                           workers=workers)
        wide = [r for first, w in self.wide for r in range(first, first + w)]
        out[wide] = groups(scaled[wide], [parts[r] for r in wide], keys[wide], values[wide],
                           [claimed[r] for r in wide], [w for _, w in self.wide], workers=workers)
        return out


def _packing(layer: Any) -> tuple[int, int] | None:
    """(bits, group size) of a layer whose K/V the hot pool packs; None: float32 arrays."""
    return (layer.bits, layer.group_size) if isinstance(layer, QuantizedFullKV) else None


def _rms_norm(x: np.ndarray, norm: nn.RMSNorm) -> np.ndarray:
    """``mx.fast.rms_norm``: ``x / sqrt(mean(x**2) + eps) * weight``, summed in float32."""
    mean = np.einsum("ij,ij->i", x, x, dtype=np.float32) / np.float32(x.shape[-1])
    return x * (np.float32(1.0) / np.sqrt(mean + np.float32(norm.eps)))[:, None] * np.asarray(norm.weight)


def _linear(x: np.ndarray, layer: nn.Linear, linear_pass: bool) -> np.ndarray:
    out = _times(x, np.asarray(layer.weight), linear_pass)
    return out + np.asarray(layer.bias) if "bias" in layer else out


def _times(x: np.ndarray, weight: np.ndarray, linear_pass: bool) -> np.ndarray:
    """``x @ weight.T``: the few-row pass (``linear_kernel``) where it is faster than BLAS, else BLAS."""
    out = host_linear.times(x, weight, host_linear.HOST_STEP_MAX_ROWS) if linear_pass else None
    return x @ weight.T if out is None else out


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope: nn.RoPE) -> np.ndarray:
    """``nn.RoPE`` on (batch, heads, dim) at each row's position; ``cos``/``sin`` (batch, dims / 2)."""
    dims = rope.dims
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    if rope.traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2] = x1 * c - x2 * s
        out[..., 1:dims:2] = x1 * s + x2 * c
    else:
        half = dims // 2
        x1, x2 = x[..., :half], x[..., half:dims]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:dims] = x1 * s + x2 * c
    return out


def _swiglu(gate: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``silu(gate) * x`` as ``gate / (1 + exp(-gate)) * x`` (where ``exp`` overflows, -0, as MLX's is)."""
    with np.errstate(over="ignore"):
        return gate / (np.float32(1.0) + np.exp(-gate)) * x
