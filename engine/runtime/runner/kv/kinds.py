"""Which layer-cache classes a sequence's KV is made of: chosen by the compute backend, once.

MLX's kernels run on :class:`FullKV` and :class:`WindowKV` as they are. The
CPU backend brings subclasses that attend with its own arithmetic and keep
the bookkeeping its in-place decode writes need; on Metal and CUDA none of
that exists, so none of it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.runner.kv.chunked_kv import ChunkedKV
from engine.runtime.runner.kv.full_kv import FullKV
from engine.runtime.runner.kv.window_kv import WindowKV


@dataclass(frozen=True, slots=True)
class LayerKinds:
    full: type[FullKV] = FullKV
    window: type[WindowKV] = WindowKV
    chunked: type[ChunkedKV] = ChunkedKV


MLX_KINDS = LayerKinds()
