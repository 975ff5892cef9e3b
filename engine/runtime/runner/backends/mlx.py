"""The compute backend that runs everything through MLX's own kernels: Metal, CUDA, and the CPU when asked.

It adds nothing to MLX: it is what Metal and CUDA run, and what the CPU runs
with ``--no-fast-cpu-math``. Its steps are ``mlx_passes.py``'s, through MLX's
forward; the CPU's own backend (``backends/cpu/``) implements the same
interface (``protocol.Backend``) with the host paths that pay there.

One backend object serves one engine and its model; it is chosen once, in
``backends/__init__.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import mlx.core as mx

import engine.runtime.runner.backends.mlx_passes as mlx_passes
from engine.domain.cache_spec import ModelCacheSpec
from engine.runtime.runner.backends.protocol import PromptChunk
from engine.runtime.runner.kv import ragged
from engine.runtime.runner.kv.kinds import MLX_KINDS, LayerKinds
from engine.runtime.runner.kv.padded import PaddedLayerCache
from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.runtime.runner.sampling import mlx_top_k


class MlxBackend:
    """``protocol.Backend`` through MLX's own kernels."""

    name = "mlx"
    kinds: LayerKinds = MLX_KINDS

    def __init__(self) -> None:
        self._hooks = mlx_passes.RaggedHooks()

    # -- the model -----------------------------------------------------------------------
    def kinds_for(self, spec: ModelCacheSpec) -> LayerKinds:
        return self.kinds

    def attach(self, model: Any, batchable: bool = True) -> bool:
        return self._hooks.attach(model, batchable)

    def detach(self, model: Any) -> None:
        self._hooks.detach(model)

    def close(self) -> None:
        """Nothing of its own to stop."""

    def await_warm_up(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """MLX's own kernels load with MLX: nothing to wait for."""

    def batched_attention(self, model: Any) -> bool:
        return self._hooks.attach(model)

    def vision_pass(self) -> ContextManager[None]:
        """MLX's own kernels for a vision tower too."""
        return contextlib.nullcontext()

    # -- forward passes ------------------------------------------------------------------
    def forward(self, model: Any, inputs: mx.array, cache: Any, embeddings: mx.array | None = None) -> mx.array:
        return mlx_passes.forward(model, inputs, cache, embeddings)

    def ragged(self, layers: Sequence[Any]) -> ragged.RaggedLayerCache:
        """One layer of a batch: row ``b`` attends to ``layers[b]``."""
        return ragged.RaggedLayerCache(layers)

    def padded(self, layers: Sequence[Any]) -> PaddedLayerCache:
        """One layer of a batch of a model that reads the K/V it fetches: row ``b``'s fetch is ``layers[b]``'s."""
        return PaddedLayerCache(layers)

    def layer_views(self, rows: Sequence[SequenceKV]) -> list[Any]:
        return mlx_passes.layer_views(rows, self.ragged, self.padded)

    def carries_prompts(self, model: Any, rows: Sequence[SequenceKV], chunks: Sequence[tuple[SequenceKV, int]],
                        widths: Sequence[int] | None = None) -> bool:
        """Never: MLX's forward feeds every row as many tokens, so a prompt chunk takes a prefill pass of its own."""
        return False

    def decode(self, model: Any, inputs: mx.array, rows: Sequence[SequenceKV],
               chunks: Sequence[PromptChunk] = ()) -> mx.array:
        return mlx_passes.decode(self, model, inputs, rows, chunks)

    def verify(self, model: Any, inputs: Sequence[Sequence[int]], rows: Sequence[SequenceKV],
               chunks: Sequence[PromptChunk] = ()) -> tuple[mx.array, bool]:
        return mlx_passes.verify(self, model, inputs, rows, chunks)

    def draft_row_cost(self, model: Any) -> float:
        return mlx_passes.draft_row_cost()

    def draft_token_cost(self, model: Any) -> float:
        """What any token costs: a verification is MLX's forward over every sequence's tokens."""
        return mlx_passes.draft_row_cost()

    # -- sampling ------------------------------------------------------------------------
    def top_k_of_logits(self, logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
        return mlx_top_k(logits, k)

    def describe(self) -> dict[str, object]:
        return {"compute": self.name, "device": str(mx.default_device())}
