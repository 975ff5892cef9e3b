"""A batch's steps through the model's own forward, as every backend runs them where nothing faster applies.

MLX's backend runs every step this way; the CPU's backend runs the steps its
host paths do not take this way, with its own forward and layer views. Each
function takes the backend it runs for (``protocol.Backend``), so a pass goes
through that backend's :meth:`forward`, :meth:`layer_views` and (for a
speculative step split by width) its :meth:`verify` and :meth:`decode`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx

from engine.runtime.runner import llama4_rows, rotary_passes
from engine.runtime.runner.backends.protocol import Backend, PromptChunk
from engine.runtime.runner.kv import ragged
from engine.runtime.runner.kv.full_kv import FullKV
from engine.runtime.runner.kv.recurrent_state import RecurrentState
from engine.runtime.runner.kv.sequence_kv import SequenceKV, model_caches
from engine.runtime.runner.kv.stacked_state import StackedStates


class RaggedHooks:
    """Which attached models' attention goes through the ragged hook (kv/ragged.py), each model's rows then
    attending to their own caches in one pass; Llama 4's chunk masks made per row (llama4_rows.py)."""

    def __init__(self) -> None:
        self._batched: dict[int, bool] = {}  # id(model) -> whether its rows share a pass

    def attach(self, model: Any, batchable: bool = True) -> bool:
        """Install the hooks on ``model`` (once; again is a no-op). Returns whether its sequences can share a
        forward pass: the ragged hook took its attention, and the model builds no row's mask from another
        row's cache (``batchable``: the cache spec's word on that)."""
        key = id(model)
        if key not in self._batched:
            self._batched[key] = ragged.install(model) and batchable
            llama4_rows.install(model)
        return self._batched[key]

    def attached(self, model: Any) -> bool:
        return id(model) in self._batched

    def detach(self, model: Any) -> None:
        """Undo :meth:`attach` (the ragged hook stays while another engine runs a model of the same family)."""
        if self._batched.pop(id(model), None) is not None:
            ragged.uninstall(model)
            llama4_rows.uninstall(model)


def forward(model: Any, inputs: mx.array, cache: Any, embeddings: mx.array | None = None) -> mx.array:
    """The model over ``inputs`` (batch, tokens), writing ``cache``; its logits (not evaluated). ``embeddings``
    (batch, tokens, hidden) replace the tokens' own where given (a prompt's images). Each row rotates at its
    own rotary positions where a multi-axis model's images moved them (rotary_passes.py)."""
    with rotary_passes.positioned(model, cache, inputs.shape[1]):
        if embeddings is not None:
            return model(inputs, cache=cache, input_embeddings=embeddings)
        return model(inputs, cache=cache)


def layer_views(rows: Sequence[SequenceKV], ragged_view: Callable[[Sequence[Any]], Any],
                padded_view: Callable[[Sequence[Any]], Any]) -> list[Any]:
    """The caches a batch's forward pass takes: per layer, a view of every row's cache of that layer
    (``ragged_view``: row ``b`` attends to ``layers[b]``) and for a KV-shared layer, a view of the layer it
    reads. A model that computes with the K/V it fetches (latent attention) is handed every row's K/V,
    padded (``padded_view``, kv/padded.py); recurrent layers' states stacked."""
    views: list[Any] = []
    spec = rows[0].spec
    for i, first in enumerate(rows[0].layers):
        layers = [kv.layers[i] for kv in rows]
        if isinstance(first, RecurrentState):
            views.append(StackedStates(layers))
        else:
            views.append(padded_view(layers) if spec.latent else ragged_view(layers))
    return model_caches(spec, views + [views[source].shared() for source in spec.shared_layers])


def decode(backend: Backend, model: Any, inputs: mx.array, rows: Sequence[SequenceKV],
           chunks: Sequence[PromptChunk] = ()) -> mx.array:
    """The logits (batch, vocabulary) of one decode step through ``backend``'s forward: row ``b`` feeds
    ``inputs[b]`` to ``rows[b]``; ``chunks`` (prompt tokens each cache takes, no logits of their own) each in a
    pass of their own first, as MLX's forward feeds every row as many tokens."""
    feed_apart(backend, model, chunks)
    if len(rows) == 1:
        return backend.forward(model, inputs[:, None], rows[0].caches())[:, -1, :]
    if backend.batched_attention(model):
        return backend.forward(model, inputs[:, None], backend.layer_views(rows))[:, -1, :]
    # No hook for this model's attention: one forward pass per sequence.
    return mx.concatenate(
        [backend.forward(model, inputs[b:b + 1, None], kv.caches())[:, -1, :] for b, kv in enumerate(rows)]
    )


def verify(backend: Backend, model: Any, inputs: Sequence[Sequence[int]], rows: Sequence[SequenceKV],
           chunks: Sequence[PromptChunk] = ()) -> tuple[mx.array, bool]:
    """A speculative step through ``backend``'s forward: row ``b`` feeds ``inputs[b]`` (its last token, then its
    drafts) to ``rows[b]``; ``chunks`` as in :func:`decode`.

    Returns the logits of every fed token, rows after one another (sum of the widths, vocabulary), and
    whether the positions were written in place (never here). Rows of one width share a pass; rows of
    several widths are padded to the widest (filler the causal mask hides, dropped after) where no row's cache
    forgets and every row's arrays have room for the filler, else each width takes its own pass (through
    ``backend.verify``, which may take a faster path for it).
    """
    feed_apart(backend, model, chunks)
    widths = [len(tokens) for tokens in inputs]
    if all(w == 1 for w in widths):
        return backend.decode(model, mx.array([tokens[0] for tokens in inputs], dtype=mx.uint32), rows), False
    if len(rows) == 1:
        return backend.forward(model, mx.array([list(inputs[0])], dtype=mx.uint32), rows[0].caches())[0], False
    if not backend.batched_attention(model):
        return mx.concatenate([backend.forward(model, mx.array([list(t)], dtype=mx.uint32), kv.caches())[0]
                               for t, kv in zip(inputs, rows)]), False
    if len(set(widths)) > 1 and not all(_holds(kv, max(widths)) for kv in rows):
        logits: list[mx.array | None] = [None] * len(rows)
        for width in sorted(set(widths)):
            members = [b for b, w in enumerate(widths) if w == width]
            part, _ = backend.verify(model, [inputs[b] for b in members], [rows[b] for b in members])
            for n, b in enumerate(members):
                logits[b] = part[n * width:(n + 1) * width]
        return mx.concatenate(logits), False  # type: ignore[arg-type]
    width = max(widths)
    padded = mx.array([list(t) + [t[-1]] * (width - len(t)) for t in inputs], dtype=mx.uint32)
    out = backend.forward(model, padded, backend.layer_views(rows))
    for kv, w in zip(rows, widths):
        if w < width:
            for layer in kv.layers:
                layer.trim_to(layer.offset - (width - w))
    return mx.concatenate([out[b, :w] for b, w in enumerate(widths)]), False


def feed_apart(backend: Backend, model: Any, chunks: Sequence[PromptChunk]) -> None:
    """Prompt chunks through passes of their own (MLX's forward feeds every row as many tokens)."""
    for kv, tokens in chunks:
        backend.forward(model, mx.array([list(tokens)], dtype=mx.uint32), kv.caches())
    if chunks:
        mx.eval([a for kv, _ in chunks for a in kv.arrays()])


def draft_row_cost() -> float:
    """One more token in a pass through MLX's forward, as a share of a one-token pass
    (``drafting.allocate_drafts``).

    On MLX's CPU device, measured (SmolLM2, 1,000 tokens of context, 2 cores: a pass of 1 token 97 ms, of
    8 tokens 196 ms; bench_verify_cost, the 2-core CPU box): about 0.16. On a GPU a
    decode pass is bound by reading the weights, and a few more tokens cost little; 0.05 there is a
    guess that was not measured (no GPU here): the batch's own timing (``step_rates.py``) stops
    speculative steps that fall behind plain ones either way."""
    return 0.16 if mx.default_device().type == mx.DeviceType.cpu else 0.05


def _holds(kv: SequenceKV, n_tokens: int) -> bool:
    """Whether a row may carry filler up to ``n_tokens`` positions: it forgets nothing (filler written into a
    window would overwrite what it still needs) and its arrays have room for them."""
    return not kv.forgets and all(not isinstance(layer, FullKV) or layer.offset - layer.base + n_tokens <= layer.own_capacity
                                  for layer in kv.layers)
