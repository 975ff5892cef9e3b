"""The compute backend that runs everything through MLX's own kernels: Metal, CUDA, and the CPU when asked.

The batch (``runner/batch.py``) calls a backend for the three things that
differ between devices: a forward pass of the model over some caches, a
decode step's logits for a batch of sequences, and the top-k filter of
sampling. It also names the layer-cache classes a sequence's KV is made of
(``kv/kinds.py``) and the view of a batch's layer that attention goes through
(``kv/ragged.py``). This one adds nothing to MLX: it is what Metal and CUDA
run, and what the CPU runs with ``--no-fast-cpu-math``. The CPU's own
backend (``backends/cpu/``) derives from it and replaces what pays there.

One backend object serves one engine and its model; it is chosen once, in
``backends/__init__.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import mlx.core as mx

from engine.domain.cache_spec import ModelCacheSpec
from engine.runtime.runner import llama4_rows, rotary_passes
from engine.runtime.runner.kv import ragged
from engine.runtime.runner.kv.full_kv import FullKV
from engine.runtime.runner.kv.recurrent_state import RecurrentState
from engine.runtime.runner.kv.stacked_state import StackedStates
from engine.runtime.runner.kv.kinds import MLX_KINDS, LayerKinds
from engine.runtime.runner.kv.padded import PaddedLayerCache
from engine.runtime.runner.kv.sequence_kv import SequenceKV, model_caches
from engine.runtime.runner.sampling import mlx_top_k


class MlxBackend:
    name = "mlx"
    kinds: LayerKinds = MLX_KINDS

    def __init__(self) -> None:
        # Whether each attached model's attention goes through the ragged hook (id(model) -> answer).
        self._batched: dict[int, bool] = {}

    # -- the model -----------------------------------------------------------------------
    def kinds_for(self, spec: ModelCacheSpec) -> LayerKinds:
        """The layer cache classes a model of ``spec`` runs with on this backend."""
        return self.kinds

    def attach(self, model: Any, batchable: bool = True) -> bool:
        """Prepare ``model`` for this backend (once; again is a no-op). Returns whether its sequences can
        share a forward pass, each attending to its own cache: the ragged hook took its attention, and the
        model builds no row's mask from another row's cache (``batchable``: the cache spec's word on that)."""
        key = id(model)
        if key not in self._batched:
            self._batched[key] = ragged.install(model) and batchable
            llama4_rows.install(model)
        return self._batched[key]

    def detach(self, model: Any) -> None:
        """The engine is done with ``model``: undo what :meth:`attach` changed (the ragged hook stays while
        another engine runs a model of the same family)."""
        if self._batched.pop(id(model), None) is not None:
            ragged.uninstall(model)
            llama4_rows.uninstall(model)

    def close(self) -> None:
        """The engine is done with this backend (threads of its own, where it has any, stop)."""

    def await_warm_up(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Return once what the backend loads in the background for the attached models is loaded, reporting
        ``progress(stage, done, total)`` as a load stage: before the engine says ready, so its first request
        does not wait for it. MLX's own kernels load with MLX: nothing to wait for here."""

    def batched_attention(self, model: Any) -> bool:
        return self.attach(model)

    def vision_pass(self) -> ContextManager[None]:
        """Around a vision tower's run over an image (mlx-vlm's modules, not the attached model): where a
        backend has faster arithmetic for the tower's attention and activations, it takes them inside this.
        MLX's own kernels here."""
        return contextlib.nullcontext()

    # -- forward passes ------------------------------------------------------------------
    def forward(self, model: Any, inputs: mx.array, cache: Any, embeddings: mx.array | None = None) -> mx.array:
        """The model over ``inputs`` (batch, tokens), writing ``cache``; its logits (not evaluated). ``embeddings``
        (batch, tokens, hidden) replace the tokens' own where given (a prompt's images). Each row rotates at its
        own rotary positions where a multi-axis model's images moved them (rotary_passes.py)."""
        with rotary_passes.positioned(model, cache, inputs.shape[1]):
            if embeddings is not None:
                return model(inputs, cache=cache, input_embeddings=embeddings)
            return model(inputs, cache=cache)

    def ragged(self, layers: Sequence[Any]) -> ragged.RaggedLayerCache:
        """One layer of a batch: row ``b`` attends to ``layers[b]``."""
        return ragged.RaggedLayerCache(layers)

    def padded(self, layers: Sequence[Any]) -> PaddedLayerCache:
        """One layer of a batch of a model that reads the K/V it fetches: row ``b``'s fetch is ``layers[b]``'s."""
        return PaddedLayerCache(layers)

    def layer_views(self, rows: Sequence[SequenceKV]) -> list[Any]:
        """The caches a batch's forward pass takes: per layer, a view of every row's cache of that layer (and
        for a KV-shared layer, a view of the layer it reads). A model that computes with the K/V it fetches
        (latent attention) is handed every row's K/V, padded (kv/padded.py)."""
        views: list[Any] = []
        spec = rows[0].spec
        for i, first in enumerate(rows[0].layers):
            layers = [kv.layers[i] for kv in rows]
            if isinstance(first, RecurrentState):
                views.append(StackedStates(layers))
            else:
                views.append(self.padded(layers) if spec.latent else self.ragged(layers))
        return model_caches(rows[0].spec, views + [views[source].shared() for source in rows[0].spec.shared_layers])

    def carries_prompts(self, model: Any, rows: Sequence[SequenceKV], chunks: Sequence[tuple[SequenceKV, int]],
                        widths: Sequence[int] | None = None) -> bool:
        """Whether a decode step of ``rows`` (``widths`` tokens each in a verification) can also feed prompt
        chunks (each a sequence's cache and its number of tokens) in the same pass (``chunks`` of :meth:`decode`
        and :meth:`verify`). Not through MLX's forward, whose rows all feed as many tokens: a prompt chunk
        takes a prefill pass of its own."""
        return False

    def decode(self, model: Any, inputs: mx.array, rows: Sequence[SequenceKV],
               chunks: Sequence[tuple[SequenceKV, Sequence[int]]] = ()) -> mx.array:
        """The logits (batch, vocabulary) of one decode step: row ``b`` feeds ``inputs[b]`` to ``rows[b]``;
        ``chunks``: prompt tokens each cache takes, with no logits of their own; in the same pass where
        :meth:`carries_prompts` said so, here each in a pass of its own first."""
        self._feed_apart(model, chunks)
        if len(rows) == 1:
            return self.forward(model, inputs[:, None], rows[0].caches())[:, -1, :]
        if self.batched_attention(model):
            return self.forward(model, inputs[:, None], self.layer_views(rows))[:, -1, :]
        # No hook for this model's attention: one forward pass per sequence.
        return mx.concatenate(
            [self.forward(model, inputs[b:b + 1, None], kv.caches())[:, -1, :] for b, kv in enumerate(rows)]
        )

    def verify(self, model: Any, inputs: Sequence[Sequence[int]], rows: Sequence[SequenceKV],
               chunks: Sequence[tuple[SequenceKV, Sequence[int]]] = ()) -> tuple[mx.array, bool]:
        """A speculative step: row ``b`` feeds ``inputs[b]`` (its last token, then its drafts) to ``rows[b]``;
        ``chunks`` as in :meth:`decode`.

        Returns the logits of every fed token, rows after one another (sum of the widths, vocabulary), and
        whether the positions were written in place (never here: through MLX). Rows of one width share a
        pass; rows of several widths are padded to the widest (filler the causal mask hides, dropped after)
        where no row's cache forgets and every row's arrays have room for the filler, else each width takes its
        own pass.
        """
        self._feed_apart(model, chunks)
        widths = [len(tokens) for tokens in inputs]
        if all(w == 1 for w in widths):
            return self.decode(model, mx.array([tokens[0] for tokens in inputs], dtype=mx.uint32), rows), False
        if len(rows) == 1:
            return self.forward(model, mx.array([list(inputs[0])], dtype=mx.uint32), rows[0].caches())[0], False
        if not self.batched_attention(model):
            return mx.concatenate([self.forward(model, mx.array([list(t)], dtype=mx.uint32), kv.caches())[0]
                                   for t, kv in zip(inputs, rows)]), False
        if len(set(widths)) > 1 and not all(_holds(kv, max(widths)) for kv in rows):
            logits: list[mx.array | None] = [None] * len(rows)
            for width in sorted(set(widths)):
                members = [b for b, w in enumerate(widths) if w == width]
                part, _ = self.verify(model, [inputs[b] for b in members], [rows[b] for b in members])
                for n, b in enumerate(members):
                    logits[b] = part[n * width:(n + 1) * width]
            return mx.concatenate(logits), False  # type: ignore[arg-type]
        width = max(widths)
        padded = mx.array([list(t) + [t[-1]] * (width - len(t)) for t in inputs], dtype=mx.uint32)
        out = self.forward(model, padded, self.layer_views(rows))
        for kv, w in zip(rows, widths):
            if w < width:
                for layer in kv.layers:
                    layer.trim_to(layer.offset - (width - w))
        return mx.concatenate([out[b, :w] for b, w in enumerate(widths)]), False

    def _feed_apart(self, model: Any, chunks: Sequence[tuple[SequenceKV, Sequence[int]]]) -> None:
        """Prompt chunks through passes of their own (MLX's forward feeds every row as many tokens)."""
        for kv, tokens in chunks:
            self.forward(model, mx.array([list(tokens)], dtype=mx.uint32), kv.caches())
        if chunks:
            mx.eval([a for kv, _ in chunks for a in kv.arrays()])

    def draft_row_cost(self, model: Any) -> float:
        """One more token in a pass, as a share of a one-token pass (``drafting.allocate_drafts``).

        On MLX's CPU device, measured (SmolLM2, 1,000 tokens of context, 2 cores: a pass of 1 token 97 ms, of
        8 tokens 196 ms; bench_verify_cost, the 2-core CPU box): about 0.16. On a GPU a
        decode pass is bound by reading the weights, and a few more tokens cost little; 0.05 there is a
        guess that was not measured (no GPU here): the batch's own timing (``step_rates.py``) stops
        speculative steps that fall behind plain ones either way."""
        return 0.16 if mx.default_device().type == mx.DeviceType.cpu else 0.05

    def draft_token_cost(self, model: Any) -> float:
        """One more drafted token in a verification, as a share of a one-token pass: here what any token costs
        (a verification is MLX's forward over every sequence's tokens)."""
        return self.draft_row_cost(model)

    # -- sampling ------------------------------------------------------------------------
    def top_k_of_logits(self, logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """Each row's ``k`` largest log-probabilities (normalized over the vocabulary) and their ids."""
        return mlx_top_k(logits, k)

    # -- what it is ------------------------------------------------------------------------
    def describe(self) -> dict[str, object]:
        """For the stats: which backend runs, on which device."""
        return {"compute": self.name, "device": str(mx.default_device())}


def _holds(kv: SequenceKV, n_tokens: int) -> bool:
    """Whether a row may carry filler up to ``n_tokens`` positions: it forgets nothing (filler written into a
    window would overwrite what it still needs) and its arrays have room for them."""
    return not kv.forgets and all(not isinstance(layer, FullKV) or layer.offset - layer.base + n_tokens <= layer.own_capacity
                                  for layer in kv.layers)
