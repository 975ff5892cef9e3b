"""Derive a loaded mlx-lm model's KV-cache layout (:class:`ModelCacheSpec`).

Two questions, answered from the model itself:

* *Which kind of cache does each layer keep?* The model's own ``make_cache()``
  (mlx-lm's contract: ``KVCache`` = full attention, ``RotatingKVCache`` =
  sliding window of ``max_size`` tokens, ``ChunkedKVCache`` = chunked
  attention, ``ArraysCache`` = a recurrent state). Asking the model beats
  re-deriving the layer pattern from config fields, which every family spells
  differently.
* *How big is one token of each cache?* One token is run through fresh caches
  *lazily* (MLX builds the graph, infers every shape and dtype, and computes
  nothing): the caches then say what each layer stores, K/V and state alike,
  whichever layer of the model wrote them (Nemotron-H has layers without any
  cache). Layers may differ (Gemma 4's global layers are twice as wide): each
  kind of layer becomes groups of its own geometry. Latent attention
  (``kv_lora_rank`` in mlx-lm's absorbed form: DeepSeek V3, GLM-4.7-Flash,
  Kimi K2.5) caches one latent vector (K) and one rotary key (V) per token
  under a single head; the probe reads that too.

Layers past ``make_cache()``'s caches that read another layer's K/V (Gemma
4's ``previous_kvs``) are recorded as shared; a model with more caches than
layers (its layers run twice a token) is refused. Anything else the pool
cannot hold (quantized caches, subclasses) raises
:class:`UnsupportedModelError` here, at load time, rather than corrupting
blocks later.

A layer that keeps two caches (mlx-lm's ``CacheList``: Falcon-H1's Mamba
state beside its K/V, LongCat Flash's two attention passes, DeepSeek V3.2's
indexer keys) becomes two cache layers of the spec, each of its own kind;
``ModelCacheSpec.cache_lists`` says which cache layers each model layer takes
together, and the engine hands the model a ``CacheList`` of them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

from engine.domain.cache_spec import KVGeometry, LayerKind, ModelCacheSpec, StateGeometry, group_layers
from engine.errors import UnsupportedModelError

# Where mlx-lm families keep a decoder block's attention module (DBRX: inside its norm-attention-norm block).
_ATTENTION_ATTRS = ("self_attn", "attention", "attn", "mixer", "norm_attn_norm.attn")
# Names they give the number of KV heads the keys are reshaped to.
_KV_HEADS_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "k_num_heads")
# Names they give the number of query heads (multi-head families: also the KV heads).
_QUERY_HEADS_ATTRS = ("n_heads", "num_attention_heads", "num_heads", "n_head")

_MX_DTYPE_NAMES: dict[mx.Dtype, str] = {
    mx.float32: "float32",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
}


def derive_cache_spec(
    model: nn.Module, block_tokens: int, kv_dtype: str | None = None
) -> ModelCacheSpec:
    """The KV layout of ``model`` in blocks of ``block_tokens`` tokens.

    ``kv_dtype`` overrides the dtype K/V are stored in; by default it is the
    dtype the model produces them in (its attention weights' dtype, or the
    quantization scales' dtype for quantized layers).
    """
    try:
        return _derived(model, block_tokens, kv_dtype)
    except UnsupportedModelError as exc:  # each reason, said once with the model it is about
        raise UnsupportedModelError(f"model type {model_type_of(model)!r}: {exc}") from exc


def _derived(model: nn.Module, block_tokens: int, kv_dtype: str | None) -> ModelCacheSpec:
    spans = cache_spans(model)
    _, cache_lists = flat_caches(_fresh_caches(model))
    recurrent = [i for i, span in enumerate(spans) if span == RECURRENT]
    if not (recurrent or cache_lists):
        _one_cache_per_layer(model, len(spans))
    # Every shape and dtype from one lazily computed token through fresh caches (nothing is evaluated).
    geometries, states = probed_geometries(model)
    shared = () if recurrent or cache_lists else shared_layers(model, len(spans))
    if kv_dtype is not None:
        dtype = _checked_override(kv_dtype)
        geometries = {i: replace(g, dtype=dtype) for i, g in geometries.items()}
        states = {i: _state_in(state, dtype, _probed_dtype(geometries)) for i, state in states.items()}
    own = Counter(geometries.values()).most_common(1)[0][0] if geometries else _nominal(states)
    kinds = [LayerKind(state=states[i]) if i in states else
             LayerKind(window, chunk, None if geometries[i] == own else geometries[i])
             for i, (window, chunk) in enumerate(spans)]
    attentions = [attn for layer in _layers(model) for attn in _attention_modules(layer)]
    latent = any(caches_latents(attn) for attn in attentions)
    # DeepSeek V3.2's sparse-attention indexer reads and re-ties its caches' arrays itself (``cache.keys``).
    indexed = any(isinstance(getattr(attn, "indexer", None), nn.Module) for attn in attentions)
    chunked = any(span != RECURRENT and span[1] is not None for span in spans)
    return ModelCacheSpec(
        n_layers=len(spans),
        n_kv_heads=own.n_kv_heads,
        head_dim=own.head_dim,
        v_head_dim=own.v_head_dim if own.v_head_dim != own.head_dim else None,
        dtype=own.dtype,
        block_tokens=block_tokens,
        groups=group_layers(kinds),
        layer_windows=tuple(None if span == RECURRENT else span[0] for span in spans),
        layer_chunks=tuple(None if span == RECURRENT else span[1] for span in spans) if chunked else (),
        shared_layers=shared,
        # An indexer works on its cache's arrays itself: each row runs its own pass.
        batchable=not indexed,
        latent=latent,
        cache_lists=cache_lists,
    )


def model_type_of(model: nn.Module) -> str:
    """The mlx-lm model type (``llama``, ``gemma3_text``...), for error messages."""
    declared = getattr(model, "model_type", None) or getattr(model_args(model), "model_type", None)
    return str(declared or type(model).__module__)


def model_args(model: nn.Module) -> Any:
    """The ModelArgs the model was built from (a few families call it ``config``)."""
    return getattr(model, "args", None) or getattr(model, "config", None)


# -- cache kinds ------------------------------------------------------------------


# A recurrent layer's span: it keeps no position at all.
RECURRENT = (-1, -1)


def cache_spans(model: nn.Module) -> list[tuple[int | None, int | None]]:
    """Per cache layer (a ``CacheList``'s members each one): (sliding window, chunk), both None for full
    attention; ``RECURRENT`` for a recurrent layer."""
    caches, _ = flat_caches(_fresh_caches(model))
    if not caches:
        raise UnsupportedModelError("it keeps no KV cache")
    return [_span_of(cache, layer) for layer, cache in enumerate(caches)]


def flat_caches(caches: list[Any]) -> tuple[list[Any], tuple[tuple[int, ...], ...]]:
    """mlx-lm's per-layer caches with each ``CacheList``'s members in its place, and which of those each
    model layer takes (``()`` when no layer keeps a ``CacheList``: one each, as they are)."""
    if not any(type(cache) is CacheList for cache in caches):
        return list(caches), ()
    flat: list[Any] = []
    lists: list[tuple[int, ...]] = []
    for cache in caches:
        members = list(cache.caches) if type(cache) is CacheList else [cache]
        lists.append(tuple(range(len(flat), len(flat) + len(members))))
        flat += members
    return flat, tuple(lists)


def _fresh_caches(model: nn.Module) -> list[Any]:
    # Same rule as mlx_lm.models.cache.make_prompt_cache without max_kv_size:
    # a model without make_cache gets one plain KVCache per layer.
    if hasattr(model, "make_cache"):
        return list(model.make_cache())
    return [KVCache() for _ in model.layers]


def _span_of(cache: Any, layer: int) -> tuple[int | None, int | None]:
    # Exact type checks: a subclass may store its arrays differently, and the
    # pool copies K/V blocks assuming exactly these layouts.
    if type(cache) is KVCache:
        return None, None
    if type(cache) is RotatingKVCache:
        return _sliding_window(cache, layer), None
    if type(cache) is ChunkedKVCache:
        if not isinstance(cache.chunk_size, int) or cache.chunk_size <= 0:
            raise UnsupportedModelError(f"layer {layer} has an invalid chunk size "
                                        f"{cache.chunk_size!r}")
        return None, cache.chunk_size
    if type(cache) is ArraysCache:
        return RECURRENT
    raise UnsupportedModelError(
        f"layer {layer} uses {type(cache).__name__}; the pool holds KVCache, "
        "RotatingKVCache, ChunkedKVCache and ArraysCache (recurrent state) layers"
    )


# -- what one token leaves in fresh caches ---------------------------------------------


def probed_geometries(model: nn.Module) -> tuple[dict[int, KVGeometry], dict[int, StateGeometry]]:
    """Per cache: the K/V geometry or recurrent state one lazily computed token leaves in it."""
    caches = _fresh_caches(model)
    try:
        model(mx.array([[0]]), cache=caches)  # a graph only: nothing here is evaluated
    except Exception as exc:  # noqa: BLE001 (a model that cannot take one token cannot be served)
        raise UnsupportedModelError(f"one token through fresh caches failed "
                                    f"({type(exc).__name__}: {exc})") from exc
    geometries: dict[int, KVGeometry] = {}
    states: dict[int, StateGeometry] = {}
    for i, cache in enumerate(flat_caches(caches)[0]):
        if type(cache) is ArraysCache:
            states[i] = _state_of(cache, i)
        elif cache.keys is None:
            raise UnsupportedModelError(f"layer {i}'s cache was not written by a "
                                        "forward pass")
        else:
            keys, values = cache.keys, cache.values
            geometries[i] = KVGeometry(keys.shape[1], keys.shape[3], values.shape[3], _dtype_name(keys.dtype))
    return geometries, states


def _state_of(cache: ArraysCache, layer: int) -> StateGeometry:
    arrays = []
    for slot, array in enumerate(cache.cache):
        if array is None:
            raise UnsupportedModelError(f"layer {layer}'s recurrent state slot {slot} "
                                        "stays empty after a token")
        arrays.append((tuple(array.shape[1:]), _dtype_name(array.dtype)))
    return StateGeometry(tuple(arrays))


def _dtype_name(dtype: mx.Dtype) -> str:
    if dtype not in _MX_DTYPE_NAMES:
        raise UnsupportedModelError(f"a cache holds {dtype}, not a float dtype")
    return _MX_DTYPE_NAMES[dtype]


def _probed_dtype(geometries: dict[int, KVGeometry]) -> str | None:
    return next(iter(geometries.values())).dtype if geometries else None


def _state_in(state: StateGeometry, dtype: str, activations: str | None) -> StateGeometry:
    """``state`` under a dtype override: the arrays the activations' dtype made (a convolution window) take
    it; the others (a float32 recurrent matrix) keep theirs."""
    source = activations or state.arrays[0][1]
    return StateGeometry(tuple((shape, dtype if own == source else own) for shape, own in state.arrays))


def _nominal(states: dict[int, StateGeometry]) -> KVGeometry:
    """A model of recurrent layers only stores no K/V: a nominal geometry no group uses."""
    return KVGeometry(1, 1, 1, next(iter(states.values())).arrays[0][1])



def shared_layers(model: nn.Module, n_caches: int) -> tuple[int, ...]:
    """For each model layer past the ``n_caches`` cache layers, the cache layer whose K/V it attends to."""
    layers = _layers(model)
    if len(layers) <= n_caches:
        return ()
    body = _body(model)
    sources = getattr(body, "previous_kvs", None)
    if not isinstance(sources, (list, tuple)) or len(sources) != len(layers):
        raise UnsupportedModelError(
            f"{len(layers)} layers but {n_caches} caches, and no map of which "
            "cache the others read (previous_kvs)")
    shared = tuple(int(s) for s in sources[n_caches:])
    if any(not 0 <= s < n_caches for s in shared):
        raise UnsupportedModelError(f"a KV-shared layer reads a layer without a cache")
    return shared


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(getattr(model, "layers", None) or [])


def _body(model: nn.Module) -> Any:
    """The module holding the decoder layers (``model.model``, or a language model's)."""
    for path in ("model", "language_model.model"):
        node: Any = model
        for name in path.split("."):
            node = getattr(node, name, None)
        if node is not None and hasattr(node, "layers"):
            return node
    return model


def _sliding_window(cache: RotatingKVCache, layer: int) -> int:
    # keep > 0 pins the first tokens forever (attention sinks); the pool's
    # sliding groups assume a plain window of the most recent tokens.
    if cache.keep != 0:
        raise UnsupportedModelError(
            f"layer {layer} is a RotatingKVCache with "
            f"keep={cache.keep}; only plain sliding windows (keep=0) are supported"
        )
    if not isinstance(cache.max_size, int) or cache.max_size <= 0:
        raise UnsupportedModelError(
            f"layer {layer} has an invalid sliding window "
            f"{cache.max_size!r}"
        )
    return cache.max_size


# -- K/V geometry -----------------------------------------------------------------


def _one_cache_per_layer(model: nn.Module, n_caches: int) -> None:
    """Refuse a model whose layers run more than once per token, each pass with caches of its own."""
    layers = _layers(model)
    if layers and n_caches > len(layers):
        raise UnsupportedModelError(
            f"{n_caches} caches for {len(layers)} layers (its layers run more than "
            "once per token, each pass with caches of its own); the engine keeps one cache per attention layer")


def caches_latents(attn: nn.Module | None) -> bool:
    """Latent attention in mlx-lm's absorbed form (DeepSeek V3, GLM-4.7-Flash, Mistral 4: the query is
    projected into the latent space by ``embed_q``) caches the latents; the older form (DeepSeek V2,
    MiniCPM3, Youtu) decompresses them and caches per-head K and V like any attention."""
    return attn is not None and getattr(attn, "kv_lora_rank", None) is not None and hasattr(attn, "embed_q")


def _attention_modules(layer: nn.Module) -> list[nn.Module]:
    """The layer's attention module, or each of its modules where it runs several passes (LongCat Flash keeps a
    list of two under ``self_attn``)."""
    for path in _ATTENTION_ATTRS:
        attn: Any = layer
        for name in path.split("."):
            attn = getattr(attn, name, None)
        if isinstance(attn, nn.Module):
            return [attn]
        if isinstance(attn, (list, tuple)) and attn and all(isinstance(a, nn.Module) for a in attn):
            return list(attn)
    return []


def _checked_override(kv_dtype: str) -> str:
    if kv_dtype not in _MX_DTYPE_NAMES.values():
        raise ValueError(
            f"kv_dtype {kv_dtype!r} is not a float dtype the KV cache can hold; "
            f"choose one of {sorted(_MX_DTYPE_NAMES.values())}"
        )
    return kv_dtype
