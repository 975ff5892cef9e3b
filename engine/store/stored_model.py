"""What the cache files need to know of the loaded model, as plain data: no MLX module, no tokenizer.

The warm tier and the prefix store write and check files against these
facts only (the model's identity, its cache layout, the shard a rank holds,
and the mlx-lm cache class each layer's state is restored into), so the
store below the engine never holds the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.models.cache_spec import ModelCacheSpec, flat_caches
from engine.models.loaded import LoadedModel, ModelIdentity


@dataclass(frozen=True)
class StoredModel:
    identity: ModelIdentity
    spec: ModelCacheSpec
    cache_classes: tuple[str, ...]  # per layer: the mlx-lm cache class its state is restored into
    cache_meta: tuple[dict[str, Any], ...]  # per layer: a window's max_size and keep, else {}

    @property
    def shard(self) -> tuple[int, int] | None:
        """(rank, world size) when this process holds one shard of the model."""
        return self.spec.shard


def stored_model(loaded: LoadedModel) -> StoredModel:
    """The loaded model's facts for the store: its caches' classes from one fresh ``make_cache()``."""
    model = loaded.model
    caches = flat_caches(model.make_cache())[0] if hasattr(model, "make_cache") else [None] * loaded.spec.n_layers
    classes = tuple(type(cache).__name__ if cache is not None else "KVCache" for cache in caches)
    meta = tuple({"max_size": cache.max_size, "keep": cache.keep} if hasattr(cache, "max_size") else {}
                 for cache in caches)
    return StoredModel(loaded.identity, loaded.spec, classes, meta)
