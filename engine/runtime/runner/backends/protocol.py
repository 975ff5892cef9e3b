"""What the batch and the engine call on a compute backend: the one interface every backend implements.

A backend computes the model for one engine: forward passes over some caches,
a decode step's logits for a batch of sequences (and a speculative step's),
sampling's top-k filter, and the layer-cache classes a sequence's K/V is made
of. ``mlx.py`` implements it with MLX's own kernels (Metal, CUDA, the CPU when
asked); ``cpu/backend.py`` with the host paths that pay on MLX's CPU device.
Neither derives from the other: what both do through MLX's forward lives in
``mlx_passes.py`` as functions over this interface.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol, Sequence, runtime_checkable

import mlx.core as mx

from engine.domain.cache_spec import ModelCacheSpec
from engine.runtime.runner.kv.kinds import LayerKinds
from engine.runtime.runner.kv.sequence_kv import SequenceKV

# A prompt chunk fed in a decode or speculative step: a sequence's cache and the tokens it takes.
PromptChunk = tuple[SequenceKV, Sequence[int]]


@runtime_checkable
class Backend(Protocol):
    name: str

    # -- the model -----------------------------------------------------------------------
    def kinds_for(self, spec: ModelCacheSpec) -> LayerKinds:
        """The layer cache classes a model of ``spec`` runs with on this backend."""
        ...

    def attach(self, model: Any, batchable: bool = True) -> bool:
        """Prepare ``model`` (once; again is a no-op). Returns whether its sequences can share a forward pass,
        each attending to its own cache."""
        ...

    def detach(self, model: Any) -> None:
        """The engine is done with ``model``: undo what :meth:`attach` changed."""
        ...

    def close(self) -> None:
        """The engine is done with this backend (threads of its own, where it has any, stop)."""
        ...

    def await_warm_up(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Return once what the backend loads in the background is loaded, reporting ``progress(stage, done,
        total)``."""
        ...

    def batched_attention(self, model: Any) -> bool:
        """Whether ``model``'s rows share a forward pass (what :meth:`attach` answered)."""
        ...

    def vision_pass(self) -> ContextManager[None]:
        """Around a vision tower's run over an image: where the backend has faster arithmetic for it."""
        ...

    # -- forward passes ------------------------------------------------------------------
    def forward(self, model: Any, inputs: mx.array, cache: Any, embeddings: mx.array | None = None) -> mx.array:
        """The model over ``inputs`` (batch, tokens), writing ``cache``; its logits (not evaluated)."""
        ...

    def layer_views(self, rows: Sequence[SequenceKV]) -> list[Any]:
        """The caches a batch's forward pass takes: per layer, a view of every row's cache of that layer."""
        ...

    def carries_prompts(self, model: Any, rows: Sequence[SequenceKV], chunks: Sequence[tuple[SequenceKV, int]],
                        widths: Sequence[int] | None = None) -> bool:
        """Whether a decode step of ``rows`` can also feed prompt chunks in the same pass; with no ``rows``,
        whether :meth:`decode` runs a prefill pass of the chunks alone (each chunk ``m`` tokens, unpadded)."""
        ...

    def decode(self, model: Any, inputs: mx.array, rows: Sequence[SequenceKV],
               chunks: Sequence[PromptChunk] = ()) -> mx.array:
        """The logits (batch, vocabulary) of one decode step: row ``b`` feeds ``inputs[b]`` to ``rows[b]``."""
        ...

    def verify(self, model: Any, inputs: Sequence[Sequence[int]], rows: Sequence[SequenceKV],
               chunks: Sequence[PromptChunk] = ()) -> tuple[mx.array, bool]:
        """A speculative step's logits for every fed token, and whether positions were written in place."""
        ...

    def draft_row_cost(self, model: Any) -> float:
        """One more token in a pass, as a share of a one-token pass."""
        ...

    def draft_token_cost(self, model: Any) -> float:
        """One more drafted token in a verification, as a share of a one-token pass."""
        ...

    # -- sampling ------------------------------------------------------------------------
    def top_k_of_logits(self, logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """Each row's ``k`` largest log-probabilities (normalized over the vocabulary) and their ids."""
        ...

    def describe(self) -> dict[str, object]:
        """For the stats: which backend runs, on which device."""
        ...
