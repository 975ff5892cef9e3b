"""Derive a loaded mlx-lm model's KV-cache layout (:class:`ModelCacheSpec`).

Two questions, answered from two sources:

* *Which kind of cache does each layer keep?* The model's own ``make_cache()``
  (mlx-lm's contract: ``KVCache`` = full attention, ``RotatingKVCache`` =
  sliding window of ``max_size`` tokens). Asking the model beats re-deriving
  the layer pattern from config fields, which every family spells differently.
* *How big is one token of K and V?* The attention modules: the KV head count
  they reshape to and the widths of ``k_proj``/``v_proj`` (the tensors the
  cache actually stores), falling back to ``model.args``. Layers may differ
  (Gemma 4's global layers are twice as wide): each kind of layer becomes
  groups of its own geometry. Latent attention (``kv_lora_rank``: DeepSeek V3,
  GLM-4.7-Flash, Kimi K2.5) caches one latent vector (K) and one rotary key (V)
  per token under a single head.

Layers past ``make_cache()``'s caches that read another layer's K/V (Gemma
4's ``previous_kvs``) are recorded as shared.

Recurrent layers (linear attention, Mamba, RWKV: ``ArraysCache``) keep arrays
whose shapes only the model's code knows. For a model with any, one token is
run through fresh caches *lazily* (MLX builds the graph, infers every shape,
and computes nothing): the caches then say what each layer stores, K/V and
state alike, whichever layer of the model wrote them (Nemotron-H has layers
without any cache). Anything else the pool cannot hold (quantized caches,
subclasses) raises :class:`UnsupportedModelError` here, at load time, rather
than corrupting blocks later.

A layer that keeps two caches (mlx-lm's ``CacheList``: Falcon-H1's Mamba
state beside its K/V, LongCat Flash's two attention passes, DeepSeek V3.2's
indexer keys) becomes two cache layers of the spec, each of its own kind;
``ModelCacheSpec.cache_lists`` says which cache layers each model layer takes
together, and the engine hands the model a ``CacheList`` of them. Such a
model is probed like a recurrent one (its attention modules do not say which
member holds what).
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
    model_type = model_type_of(model)
    spans = cache_spans(model, model_type)
    _, cache_lists = flat_caches(_fresh_caches(model))
    recurrent = [i for i, span in enumerate(spans) if span == RECURRENT]
    if recurrent or cache_lists:
        geometries, states = probed_geometries(model, model_type)
        shared: tuple[int, ...] = ()
    else:
        geometries, states = layer_geometries(model, model_type, len(spans)), {}
        shared = shared_layers(model, model_type, len(spans))
    if kv_dtype is not None:
        dtype = _checked_override(kv_dtype)
        geometries = {i: replace(g, dtype=dtype) for i, g in geometries.items()}
        states = {i: _state_in(state, dtype, _probed_dtype(geometries)) for i, state in states.items()}
    own = Counter(geometries.values()).most_common(1)[0][0] if geometries else _nominal(states)
    kinds = [LayerKind(state=states[i]) if i in states else
             LayerKind(window, chunk, None if geometries[i] == own else geometries[i])
             for i, (window, chunk) in enumerate(spans)]
    latent = any(caches_latents(attn) for layer in _layers(model) for attn in _attention_modules(layer))
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
        # The model reads the fetched K/V itself (latent scores, a chunk mask from the first cache): each row
        # of a batch must run its own forward pass on its own caches.
        batchable=not (latent or chunked),
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


def cache_spans(model: nn.Module, model_type: str) -> list[tuple[int | None, int | None]]:
    """Per cache layer (a ``CacheList``'s members each one): (sliding window, chunk), both None for full
    attention; ``RECURRENT`` for a recurrent layer."""
    caches, _ = flat_caches(_fresh_caches(model))
    if not caches:
        raise UnsupportedModelError(f"model type {model_type!r} keeps no KV cache")
    return [_span_of(cache, layer, model_type) for layer, cache in enumerate(caches)]


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


def _span_of(cache: Any, layer: int, model_type: str) -> tuple[int | None, int | None]:
    # Exact type checks: a subclass may store its arrays differently, and the
    # pool copies K/V blocks assuming exactly these layouts.
    if type(cache) is KVCache:
        return None, None
    if type(cache) is RotatingKVCache:
        return _sliding_window(cache, layer, model_type), None
    if type(cache) is ChunkedKVCache:
        if not isinstance(cache.chunk_size, int) or cache.chunk_size <= 0:
            raise UnsupportedModelError(f"model type {model_type!r}: layer {layer} has an invalid chunk size "
                                        f"{cache.chunk_size!r}")
        return None, cache.chunk_size
    if type(cache) is ArraysCache:
        return RECURRENT
    raise UnsupportedModelError(
        f"model type {model_type!r}: layer {layer} uses {type(cache).__name__}; the pool holds KVCache, "
        "RotatingKVCache, ChunkedKVCache and ArraysCache (recurrent state) layers"
    )


# -- what one token leaves in fresh caches ---------------------------------------------


def probed_geometries(model: nn.Module, model_type: str) -> tuple[dict[int, KVGeometry], dict[int, StateGeometry]]:
    """Per cache: the K/V geometry or recurrent state one lazily computed token leaves in it."""
    caches = _fresh_caches(model)
    try:
        model(mx.array([[0]]), cache=caches)  # a graph only: nothing here is evaluated
    except Exception as exc:  # noqa: BLE001 (a model that cannot take one token cannot be served)
        raise UnsupportedModelError(f"model type {model_type!r}: one token through fresh caches failed "
                                    f"({type(exc).__name__}: {exc})") from exc
    geometries: dict[int, KVGeometry] = {}
    states: dict[int, StateGeometry] = {}
    for i, cache in enumerate(flat_caches(caches)[0]):
        if type(cache) is ArraysCache:
            states[i] = _state_of(cache, i, model_type)
        elif cache.keys is None:
            raise UnsupportedModelError(f"model type {model_type!r}: layer {i}'s cache was not written by a "
                                        "forward pass")
        else:
            keys, values = cache.keys, cache.values
            geometries[i] = KVGeometry(keys.shape[1], keys.shape[3], values.shape[3], _dtype_name(keys.dtype, model_type))
    return geometries, states


def _state_of(cache: ArraysCache, layer: int, model_type: str) -> StateGeometry:
    arrays = []
    for slot, array in enumerate(cache.cache):
        if array is None:
            raise UnsupportedModelError(f"model type {model_type!r}: layer {layer}'s recurrent state slot {slot} "
                                        "stays empty after a token")
        arrays.append((tuple(array.shape[1:]), _dtype_name(array.dtype, model_type)))
    return StateGeometry(tuple(arrays))


def _dtype_name(dtype: mx.Dtype, model_type: str) -> str:
    if dtype not in _MX_DTYPE_NAMES:
        raise UnsupportedModelError(f"model type {model_type!r}: a cache holds {dtype}, not a float dtype")
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



def shared_layers(model: nn.Module, model_type: str, n_caches: int) -> tuple[int, ...]:
    """For each model layer past the ``n_caches`` cache layers, the cache layer whose K/V it attends to."""
    layers = _layers(model)
    if len(layers) <= n_caches:
        return ()
    body = _body(model)
    sources = getattr(body, "previous_kvs", None)
    if not isinstance(sources, (list, tuple)) or len(sources) != len(layers):
        raise UnsupportedModelError(
            f"model type {model_type!r}: {len(layers)} layers but {n_caches} caches, and no map of which "
            "cache the others read (previous_kvs)")
    shared = tuple(int(s) for s in sources[n_caches:])
    if any(not 0 <= s < n_caches for s in shared):
        raise UnsupportedModelError(f"model type {model_type!r}: a KV-shared layer reads a layer without a cache")
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


def _sliding_window(cache: RotatingKVCache, layer: int, model_type: str) -> int:
    # keep > 0 pins the first tokens forever (attention sinks); the pool's
    # sliding groups assume a plain window of the most recent tokens.
    if cache.keep != 0:
        raise UnsupportedModelError(
            f"model type {model_type!r}: layer {layer} is a RotatingKVCache with "
            f"keep={cache.keep}; only plain sliding windows (keep=0) are supported"
        )
    if not isinstance(cache.max_size, int) or cache.max_size <= 0:
        raise UnsupportedModelError(
            f"model type {model_type!r}: layer {layer} has an invalid sliding window "
            f"{cache.max_size!r}"
        )
    return cache.max_size


# -- K/V geometry -----------------------------------------------------------------


def layer_geometries(model: nn.Module, model_type: str, n_caches: int) -> dict[int, KVGeometry]:
    """The K/V geometry of each of the first ``n_caches`` layers (the ones holding a cache)."""
    args = model_args(model)
    layers = _layers(model)
    if layers and n_caches > len(layers):
        raise UnsupportedModelError(
            f"model type {model_type!r}: {n_caches} caches for {len(layers)} layers (its layers run more than "
            "once per token, each pass with caches of its own); the engine keeps one cache per attention layer")
    layers = layers[:n_caches]
    attentions = [_attention_of(layer) for layer in layers]
    if not attentions or any(a is None for a in attentions):
        return dict.fromkeys(range(n_caches), _args_geometry(args, model, model_type))
    return {i: _geometry(attn, args, model_type) for i, attn in enumerate(attentions)}  # type: ignore[arg-type]


def _geometry(attn: nn.Module, args: Any, model_type: str) -> KVGeometry:
    if getattr(attn, "kv_lora_rank", None) is not None:
        if caches_latents(attn):
            return _latent_geometry(attn, model_type)
        return _decompressed_geometry(attn, model_type)
    return _attention_geometry(attn, args, model_type)


def caches_latents(attn: nn.Module | None) -> bool:
    """Latent attention in mlx-lm's absorbed form (DeepSeek V3, GLM-4.7-Flash, Mistral 4: the query is
    projected into the latent space by ``embed_q``) caches the latents; the older form (DeepSeek V2,
    MiniCPM3, Youtu) decompresses them and caches per-head K and V like any attention."""
    return attn is not None and getattr(attn, "kv_lora_rank", None) is not None and hasattr(attn, "embed_q")


def _decompressed_geometry(attn: nn.Module, model_type: str) -> KVGeometry:
    """Per head: K is the no-rope part and the rotary part side by side, V ``v_head_dim`` wide."""
    heads = getattr(attn, "num_heads", None)
    nope, rope = getattr(attn, "qk_nope_head_dim", None), getattr(attn, "qk_rope_head_dim", None)
    value = getattr(attn, "v_head_dim", None)
    if not all(_positive(x) for x in (heads, nope, rope, value)):
        raise UnsupportedModelError(f"model type {model_type!r}: latent attention that caches per-head K/V "
                                    "without num_heads, qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
    return KVGeometry(heads, nope + rope, value, _module_kv_dtype(attn, model_type))


def _latent_geometry(attn: nn.Module, model_type: str) -> KVGeometry:
    """Latent attention caches ``kv_latent`` (one head of ``kv_lora_rank``) as K and the rotary ``k_pe`` (one
    head of ``qk_rope_head_dim``) as V (mlx-lm's deepseek_v3 ``update_and_fetch(kv_latent, k_pe)``)."""
    rank, rope = getattr(attn, "kv_lora_rank", None), getattr(attn, "qk_rope_head_dim", None)
    if not (_positive(rank) and _positive(rope)):
        raise UnsupportedModelError(f"model type {model_type!r}: latent attention without kv_lora_rank and "
                                    "qk_rope_head_dim")
    return KVGeometry(1, rank, rope, _module_kv_dtype(attn, model_type))


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _attention_of(layer: nn.Module) -> nn.Module | None:
    for path in _ATTENTION_ATTRS:
        attn: Any = layer
        for name in path.split("."):
            attn = getattr(attn, name, None)
        if isinstance(attn, nn.Module):
            return attn
    return None


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


def _attention_geometry(attn: nn.Module, args: Any, model_type: str) -> KVGeometry:
    n_kv_heads = _kv_heads(attn, args, model_type)
    head_dim = _proj_width(attn, "k_proj", n_kv_heads, model_type)
    head_dim = head_dim or _head_dim(attn, args, model_type)
    v_head_dim = _proj_width(attn, "v_proj", n_kv_heads, model_type) or head_dim
    return KVGeometry(n_kv_heads, head_dim, v_head_dim, _module_kv_dtype(attn, model_type))


def _args_geometry(args: Any, model: nn.Module, model_type: str) -> KVGeometry:
    # Reached only when no layer exposes an attention module under a known name.
    n_kv_heads = _kv_heads(None, args, model_type)
    head_dim = _head_dim(None, args, model_type)
    return KVGeometry(n_kv_heads, head_dim, head_dim, _module_kv_dtype(model, model_type))


def _kv_heads(attn: nn.Module | None, args: Any, model_type: str) -> int:
    """KV heads, from the most to the least direct evidence."""
    counted = _first_positive_int(attn, _KV_HEADS_ATTRS) or _kv_heads_from_k_width(attn)
    counted = counted or _first_positive_int(args, ("num_key_value_heads",))
    # No KV-head count anywhere: a multi-head family, one KV head per query head.
    counted = counted or _first_positive_int(attn, _QUERY_HEADS_ATTRS)
    counted = counted or _first_positive_int(args, _QUERY_HEADS_ATTRS)
    if counted is None:
        raise UnsupportedModelError(f"model type {model_type!r}: cannot tell its KV head count")
    return counted


def _kv_heads_from_k_width(attn: nn.Module | None) -> int | None:
    head_dim = _first_positive_int(attn, ("head_dim",))
    weight = getattr(getattr(attn, "k_proj", None), "weight", None)
    if head_dim is None or weight is None or weight.shape[0] % head_dim != 0:
        return None
    return weight.shape[0] // head_dim


def _head_dim(attn: nn.Module | None, args: Any, model_type: str) -> int:
    declared = _first_positive_int(attn, ("head_dim",))
    declared = declared or _first_positive_int(args, ("head_dim",))
    if declared is not None:
        return declared
    hidden = _first_positive_int(args, ("hidden_size",))
    heads = _first_positive_int(args, _QUERY_HEADS_ATTRS)
    if hidden is None or heads is None:
        raise UnsupportedModelError(f"model type {model_type!r}: cannot tell its head_dim")
    return hidden // heads


def _first_positive_int(source: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(source, name, None)
        # bool is an int subclass; a flag is never a head count.
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _proj_width(attn: nn.Module, name: str, n_kv_heads: int, model_type: str) -> int | None:
    """Per-head width of the K or V projection; None when the family fuses it."""
    proj = getattr(attn, name, None)
    weight = getattr(proj, "weight", None)
    if weight is None:
        return None
    # Output features are the rows for Linear and QuantizedLinear alike
    # (quantization packs the input dimension only).
    out_features = weight.shape[0]
    if out_features % n_kv_heads != 0:
        raise UnsupportedModelError(
            f"model type {model_type!r}: {name} has {out_features} outputs, "
            f"not a multiple of {n_kv_heads} KV heads"
        )
    return out_features // n_kv_heads


def _module_kv_dtype(module: nn.Module, model_type: str) -> str:
    """The dtype K/V come out in: the projection's float dtype (scales when quantized)."""
    for _, child in _projections_first(module):
        params = child.parameters()
        source = params.get("scales", params.get("weight"))
        if isinstance(source, mx.array) and source.dtype in _MX_DTYPE_NAMES:
            return _MX_DTYPE_NAMES[source.dtype]
    raise UnsupportedModelError(f"model type {model_type!r}: cannot tell the dtype of its K/V")


def _projections_first(module: nn.Module) -> list[tuple[str, nn.Module]]:
    # k_proj decides when present; otherwise any weight-bearing submodule
    # (fused qkv projections) is the best evidence available.
    named = module.named_modules()
    return sorted(named, key=lambda item: not item[0].endswith("k_proj"))


def _checked_override(kv_dtype: str) -> str:
    if kv_dtype not in _MX_DTYPE_NAMES.values():
        raise ValueError(
            f"kv_dtype {kv_dtype!r} is not a float dtype the KV cache can hold; "
            f"choose one of {sorted(_MX_DTYPE_NAMES.values())}"
        )
    return kv_dtype
