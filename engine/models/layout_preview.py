"""A model folder's cache layout without loading its weights: what ``semantic models`` says of each folder.

mlx-lm builds a model from its ``config.json``; MLX's arrays are lazy, so the
random initial weights are never computed, and ``derive_cache_spec`` reads
only the modules' structure and shapes (the K/V dtype comes from the config).
A family the block pool refuses is refused here with the same reason.
"""

from __future__ import annotations

from pathlib import Path

from engine.domain.cache_spec import ModelCacheSpec
from engine.errors import SemanticError, UnsupportedModelError
from engine.models.cache_spec import derive_cache_spec

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def preview_cache_spec(folder: Path, block_tokens: int) -> ModelCacheSpec:
    """The layout ``folder``'s model would get; UnsupportedModelError with the reason where it has none."""
    from mlx_lm.utils import _get_classes, load_config

    try:
        config = load_config(folder)
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except SemanticError:
        raise
    except Exception as exc:  # an unknown family, a config mlx-lm cannot read
        raise UnsupportedModelError(f"mlx-lm cannot build it ({type(exc).__name__}: {exc})") from exc
    text = config.get("text_config") or {}
    dtype = _DTYPES.get(str(config.get("torch_dtype") or text.get("torch_dtype") or config.get("dtype")))
    return derive_cache_spec(model, block_tokens, kv_dtype=dtype)
