"""Load one shard of a model per rank with mlx-lm's ``sharded_load`` (tensor parallel).

Tensor parallelism splits every attention layer's heads (and the MLP's
hidden width) across the ranks, so each rank's KV cache holds its share of
the KV heads: the block pool and the warm tier then work per rank unchanged.
mlx-lm's pipeline parallelism (layers split across ranks) exists only for
model families the block pool does not support yet, so it is refused with
that reason rather than half supported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.domain.cache_spec import ModelCacheSpec
from engine.errors import ModelLoadError

from engine.distributed.world import World

_HEADS_KEYS = ("num_attention_heads", "n_heads")
_KV_HEADS_KEYS = ("num_key_value_heads", "n_kv_heads")


def check_divisible(config: dict[str, Any], world: World) -> None:
    """Every rank must get the same whole number of query and KV heads."""
    sources = (config, config.get("text_config") or {})
    heads = _first(sources, _HEADS_KEYS)
    kv_heads = _first(sources, _KV_HEADS_KEYS) or heads
    for name, count in (("attention heads", heads), ("KV heads", kv_heads)):
        if count is not None and count % world.size:
            raise ModelLoadError(
                f"world size {world.size} does not divide the model's {count} {name}: tensor parallelism gives "
                f"every rank an equal share of them; run on a number of ranks that divides {count}"
            )


def check_shardable(spec: ModelCacheSpec, model_id: str) -> None:
    """Tensor parallelism splits every layer's KV heads; a layout with nothing to split is refused, saying why."""
    if spec.cache_lists:
        raise ModelLoadError(
            f"{model_id} keeps two caches in some layers (mlx-lm's CacheList), which this engine does not split "
            "across ranks; run it in one process")
    if spec.latent:
        raise ModelLoadError(
            f"{model_id} uses latent attention: each layer caches one latent head per token (K: the latent, V: the "
            "rotary key), which cannot be split across ranks by heads; run it in one process")
    if spec.recurrent_groups:
        raise ModelLoadError(
            f"{model_id} has recurrent layers (linear attention, Mamba or RWKV): the ranks would each hold a share "
            "of every sequence's state, which this engine does not split or snapshot per rank; run it in one process")


def load_shard(folder: Path, world: World, mode: str, trust_remote_code: bool) -> tuple[Any, Any, dict[str, Any]]:
    """(model shard, tokenizer, config) for this rank; ModelLoadError with the reason."""
    from mlx_lm.utils import load_config, sharded_load

    if mode != "tensor":
        raise ModelLoadError(
            f"shard mode {mode!r}: only 'tensor' is supported; mlx-lm's pipeline parallelism exists for model "
            "families (DeepSeek, Qwen3-Next, ...) whose caches the KV block pool does not hold"
        )
    check_divisible(load_config(folder), world)
    try:
        return sharded_load(str(folder), tensor_group=world.group, return_config=True,
                            tokenizer_config={"trust_remote_code": trust_remote_code},
                            trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"could not load {world.label}'s shard of {folder}: {type(exc).__name__}: {exc}") from exc


def _first(sources: tuple[dict[str, Any], ...], keys: tuple[str, ...]) -> int | None:
    for source in sources:
        for key in keys:
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None
