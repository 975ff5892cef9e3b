"""Which layer-cache classes a sequence's KV is made of: chosen by the compute backend, once.

MLX's kernels run on :class:`FullKV` and :class:`WindowKV` as they are (and on
:class:`QuantizedFullKV`, the full-attention layers the hot pool quantizes). The
CPU backend brings subclasses that attend with its own arithmetic and keep
the bookkeeping its in-place decode writes need; on Metal and CUDA none of
that exists, so none of it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.runner.kv.chunked_kv import ChunkedKV
from engine.runtime.runner.kv.full_kv import FullKV
from engine.runtime.runner.kv.quantized_kv import QuantizedFullKV
from engine.runtime.runner.kv.window_kv import WindowKV


@dataclass(frozen=True, slots=True)
class LayerKinds:
    full: type[FullKV] = FullKV
    window: type[WindowKV] = WindowKV
    chunked: type[ChunkedKV] = ChunkedKV
    # A full-attention group the hot pool quantizes (``--kv-bits``): MLX's quantized products on every backend.
    quantized: type[QuantizedFullKV] = QuantizedFullKV


MLX_KINDS = LayerKinds()
