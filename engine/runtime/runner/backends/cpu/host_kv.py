"""The CPU backend's layer caches: this package's attention, and decode positions written in place.

Through MLX, a decode step writes its new key and value into each row's
cache with two slice updates a row and layer: ~2,000 small operations a step
at 16 rows x 30 layers, each a hand-off to MLX's CPU stream. Where
``host_decode`` computes the batch's attention anyway, its loops write those
positions themselves, before the row attends. They may write in place only
where no MLX view can show the position: one never written in the arrays
held now. :class:`HostFullKV` keeps that bookkeeping (``_untouched_from``);
the MLX backend's ``FullKV`` has none of it.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any, Callable, Sequence

import mlx.core as mx

from engine.runtime.runner.backends.cpu import host_decode, host_packed_decode
from engine.runtime.runner.backends.cpu.host_attention import HOST_ATTENTION, HOST_ATTENTION_IN_GRAPH
from engine.runtime.runner.kv.attention import Attention
from engine.runtime.runner.kv.chunked_kv import ChunkedKV
from engine.runtime.runner.kv.full_kv import FullKV
from engine.runtime.runner.kv.kinds import LayerKinds
from engine.runtime.runner.kv.padded import PaddedLayerCache
from engine.runtime.runner.kv.quantized_kv import QuantizedAttention, QuantizedFullKV
from engine.runtime.runner.kv.ragged import RaggedLayerCache, _row_masks
from engine.runtime.runner.kv.window_kv import WindowKV


class HostFullKV(FullKV):
    """``FullKV`` whose next decode position may be claimed for ``host_decode`` to write in place."""

    attention: Attention = HOST_ATTENTION

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Own positions from ``_untouched_from`` on were never written in the arrays held now (None: not
        # known, as for arrays set from outside). No view can show them.
        self._untouched_from: int | None = None
        super().__init__(*args, **kwargs)

    @property
    def keys(self) -> mx.array | None:
        return self._keys

    @keys.setter
    def keys(self, array: mx.array | None) -> None:
        # (``keys[...] = x`` writes into the same array object and does not come here.)
        self._keys = array
        self._untouched_from = None

    def _arrays_replaced(self, written: int) -> None:
        self._untouched_from = written

    def _store(self, start: int, end: int, keys: mx.array, values: mx.array) -> None:
        super()._store(start, end, keys, values)
        if self._untouched_from is not None:
            self._untouched_from = max(self._untouched_from, end)

    def claim_one(self) -> int | None:
        """Take the next position for a decode step whose key and value the caller writes in place; returns
        its index in the own arrays, or None where only :meth:`append_one` may write it: a position written
        before (a view taken then may still show it), or arrays not known."""
        if not self.can_claim():
            return None
        at = self.offset - self.base
        self.offset += 1
        self._untouched_from = at + 1
        return at

    def can_claim(self, n_tokens: int = 1) -> bool:
        """Whether :meth:`claim_one` would take the next ``n_tokens`` positions (and not return None)."""
        at = self.offset - self.base
        return self._untouched_from is not None and self._untouched_from <= at and at + n_tokens <= self.own_capacity

    def give_back_claimed(self, n_tokens: int) -> None:
        """Cut back to ``n_tokens`` positions, all past it claimed and written in place by the host loops in the
        step just run (a verification's rejected drafts): no view shows them, so they may be claimed again."""
        self.trim_to(n_tokens)
        if self._untouched_from is not None:
            self._untouched_from = min(self._untouched_from, self.offset - self.base)

    def write_claimed(self, at: int, keys: mx.array, values: mx.array) -> None:
        """Write a claimed position through MLX after all (the batch's attention did not run in host_decode)."""
        self._store(at, at + 1, keys, values)


class HostWindowKV(WindowKV):
    """``WindowKV`` attending with this package's arithmetic."""

    attention: Attention = HOST_ATTENTION


class HostChunkedKV(ChunkedKV):
    """``ChunkedKV`` attending with this package's arithmetic."""

    attention: Attention = HOST_ATTENTION


class UnpackedAttention(QuantizedAttention):
    """Packed K/V unpacked, then this package's attention over them, where the packed loops do not run (prefill
    passes, one agent alone). MLX's quantized product runs as plain loops on the CPU, without BLAS: SmolLM2's
    prefill took 16 ms a token through it against 2.6 at full precision (bench_kv_bits, the 2-core x86 box).
    Unpacking a layer's K/V reads each packed value once, and the products then run in BLAS or the compiled
    rows; the values attended to are exactly the packed ones, as on Metal and CUDA."""

    def sdpa(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any, sinks: Any = None) -> mx.array:
        return HOST_ATTENTION.sdpa(queries, self.unpacked(keys).astype(queries.dtype),
                                   self.unpacked(values).astype(queries.dtype), scale, mask, sinks)

    def softmax(self, scores: mx.array) -> mx.array:
        return HOST_ATTENTION.softmax(scores)

    def product(self, left: mx.array, packed: Any, transpose: bool) -> mx.array:
        held = mx.expand_dims(self.unpacked(packed).astype(left.dtype), 2)
        return left @ (held.swapaxes(-1, -2) if transpose else held)


class HostQuantizedFullKV(HostFullKV, QuantizedFullKV):
    """``QuantizedFullKV`` whose decode position may be claimed for the packed loops (``host_packed_decode``) to
    pack and write in place, attending elsewhere over its K/V unpacked with this package's arithmetic."""

    attention_kind = UnpackedAttention


HOST_KINDS = LayerKinds(full=HostFullKV, window=HostWindowKV, chunked=HostChunkedKV, quantized=HostQuantizedFullKV)


# A hybrid model's attention layers: the same caches, their long prefill chunks' attention blocks left in
# the model's graph, not evaluated one by one (measured: host_attention.py).
class BesideRecurrentFullKV(HostFullKV):
    attention: Attention = HOST_ATTENTION_IN_GRAPH


class BesideRecurrentWindowKV(HostWindowKV):
    attention: Attention = HOST_ATTENTION_IN_GRAPH


class BesideRecurrentChunkedKV(HostChunkedKV):
    attention: Attention = HOST_ATTENTION_IN_GRAPH


HOST_KINDS_BESIDE_RECURRENT = LayerKinds(full=BesideRecurrentFullKV, window=BesideRecurrentWindowKV,
                                         chunked=BesideRecurrentChunkedKV, quantized=HostQuantizedFullKV)


class HostRaggedLayerCache(RaggedLayerCache):
    """One layer of a CPU decode batch: its positions claimed and its attention run by ``host_decode``.

    ``loops``: whether the compiled loops loaded (asked per step: they load in
    the background); ``workers``: the threads rows are split across.
    """

    def __init__(self, rows: Sequence[Any], loops: Callable[[], bool], workers: Executor | None) -> None:
        super().__init__(rows)
        self._loops = loops
        self._workers = workers
        # A decode step's new keys and values, and per row the own position host_decode writes them to
        # (None: written already, through MLX); empty when no row claimed one.
        self._new: tuple[mx.array, mx.array] | None = None
        self._claimed: list[int | None] = []

    def _decode_positions(self, keys: mx.array, values: mx.array) -> None:
        """Claimed for host_decode to write in place where it will run and the row allows it
        (``HostFullKV.claim_one``), else written now through MLX."""
        claim = self._loops() and host_decode.may_write(keys, len(self.rows))
        held: list[int] = []
        claimed: list[int | None] = []
        for b, row in enumerate(self.rows):
            at = row.claim_one() if claim and isinstance(row, HostFullKV) else None
            held.append(at + 1 if at is not None else row.append_one(keys[b:b + 1], values[b:b + 1]))
            claimed.append(at)
        self._held = held
        self._new, self._claimed = ((keys, values), claimed) if any(a is not None for a in claimed) else (None, [])

    def attend(self, queries: mx.array, scale: float, mask: Any, sinks: Any = None) -> mx.array:
        """The rows' attention; the step's claimed positions are written by the first call (a layer sharing this
        one's K/V attends again after it, over what was written)."""
        masks = _row_masks(mask, len(self.rows))
        if self._held and self._loops():
            parts = [host_decode.host_parts(row, n) for row, n in zip(self.rows, self._held)]
            new, claimed = self._new, self._claimed
            if host_packed_decode.applies(queries, parts, masks, sinks):
                self._new, self._claimed = None, []
                first = self.rows[0]
                return host_packed_decode.attend(queries, parts, scale, masks, first.bits, first.group_size,
                                                 (*new, claimed) if new else None, self._workers)
            if host_decode.applies(queries, parts, masks, sinks):
                self._new, self._claimed = None, []
                return host_decode.attend(queries, parts, scale, masks, (*new, claimed) if new else None,
                                          self._workers)
        self.write_claimed_through_mlx()  # claimed, but attention runs in MLX after all
        return self._attend_rows(queries, scale, masks, sinks)

    def write_claimed_through_mlx(self) -> None:
        """Write the step's claimed positions through MLX (attention does not run in the loops)."""
        new, claimed, self._new, self._claimed = self._new, self._claimed, None, []
        for b, at in enumerate(claimed):
            if at is not None and new is not None:
                self.rows[b].write_claimed(at, new[0][b:b + 1], new[1][b:b + 1])


class HostPaddedLayerCache(PaddedLayerCache):
    """One layer of a CPU batch of a latent-attention model: a decode step's attention runs once over the padded
    rows, each key head's query heads as its queries.

    Row by row (the base class), each row's heads are vector products MLX's CPU
    attention runs one head at a time. At 16 rows of a DeepSeek V3-shaped
    model (8 heads over 100 latents of 512) that took 4.3 ms a layer; the
    rows together, the 8 heads as one key head's 8 queries, 1.1 ms (the 2-core
    x86 box). The padding the rows then share is hidden by the mask
    the model built from :meth:`make_mask` (its rotary scores), or here where it
    passed none. These are BLAS's products, so the backend keeps the linear
    pass out of such a step (``CpuBackend.decode``).
    """

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
               sinks: Any = None) -> mx.array:
        batch, q_heads, n, dim = queries.shape
        if n > 1 or batch == 1 or sinks is not None:
            return super().attend(queries, keys, values, scale, mask, sinks)
        kv_heads = keys.shape[1]
        grouped = queries.reshape(batch, kv_heads, q_heads // kv_heads, dim)
        if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] == q_heads:
            mask = mask.reshape(mask.shape[0], kv_heads, q_heads // kv_heads, mask.shape[-1])
        elif not isinstance(mask, mx.array):
            mask = self.padding_mask()
        out = self.rows[0].attention.sdpa(grouped, keys, values, scale, mask)
        return out.reshape(batch, q_heads, 1, out.shape[-1])

