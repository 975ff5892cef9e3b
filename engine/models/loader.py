"""Turn a model reference into a LoadedModel.

A reference is a packaged-model alias (``smollm2-135m``), a ``.gguf`` file
(imported once into an MLX folder), an MLX model folder, or a hub id. All of
them end in ``mlx_lm.load`` on a folder or id, so a model served here can be
served by ``mlx_lm.server`` too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine.errors import ModelLoadError, SemanticError
from engine.models.cache_spec import derive_cache_spec, model_type_of
from engine.models.gguf_import import ImportProgress, import_gguf, read_import_marker
from engine.models.loaded import LoadedModel, ModelIdentity
from engine.models.materialize import evaluate_all_arrays
from engine.models.packaged import ensure_packaged_model, find_packaged_model
from engine.models.vision import load_vision

if TYPE_CHECKING:
    from engine.distributed.world import World

log = logging.getLogger("semantic.models")

DEFAULT_CONTEXT = 4096
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "n_ctx")

ProgressCallback = Callable[[ImportProgress], None]


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    model_id: str
    location: str  # a folder path or a hub id
    is_local: bool


def resolve_model(ref: str, cache_dir: Path, dtype: str = "auto", progress: ProgressCallback | None = None) -> ResolvedModel:
    """Where ``ref``'s MLX weights are, importing GGUF files on the way."""
    packaged = find_packaged_model(ref)
    if packaged is not None:
        folder = ensure_packaged_model(packaged.alias, cache_dir, dtype=dtype, progress=progress)
        return ResolvedModel(packaged.alias, str(folder), True)
    path = Path(ref).expanduser()
    if path.suffix.lower() == ".gguf":
        folder = import_gguf(path, cache_dir / "models", dtype=dtype, progress=progress)
        return ResolvedModel(path.stem, str(folder), True)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but has no config.json; not an MLX model folder")
        return ResolvedModel(path.name, str(path.resolve()), True)
    if path.exists() or ref.startswith((".", "/", "~")):
        raise ModelLoadError(f"model {ref!r} not found: not a folder, a .gguf file or a packaged model alias")
    return ResolvedModel(ref, ref, False)


def load_model(
    ref: str,
    cache_dir: Path,
    block_tokens: int,
    dtype: str = "auto",
    progress: ProgressCallback | None = None,
    trust_remote_code: bool = False,
    world: "World | None" = None,
    shard_mode: str = "tensor",
) -> LoadedModel:
    """Resolve, load with mlx_lm, and derive the cache layout. Raises ModelLoadError with a reason.

    With a ``world`` of several ranks this rank loads its shard (engine/distributed/sharded_loading.py);
    rank 0 resolves first, so a GGUF import or hub download happens once, not once per rank.
    """
    resolved = _resolve_once(ref, cache_dir, dtype, progress, world)
    if progress:
        progress(ImportProgress("loading", 0, 1))
    folder = Path(resolved.location) if resolved.is_local else _download_hub_model(resolved.location)
    if world is None:
        model, tokenizer, config = _mlx_load(folder, trust_remote_code)
    else:
        from engine.distributed.sharded_loading import load_shard

        model, tokenizer, config = load_shard(folder, world, shard_mode, trust_remote_code)
    spec = derive_cache_spec(model, block_tokens)
    # After deriving: a hybrid model's probe (a graph of one token, never evaluated) may leave arrays that
    # modules build on first use; everything is evaluated here, on this thread, before the engine's runs it.
    evaluate_all_arrays(model)
    if world is not None:
        from engine.distributed.sharded_loading import check_shardable

        check_shardable(spec, resolved.model_id)
        spec = replace(spec, shard=(world.rank, world.size))
    vision, vision_note = (load_vision(folder, model) if world is None
                           else (None, "it is served across ranks, and images are read on one process only"))
    if progress:
        progress(ImportProgress("loading", 1, 1))
    return LoadedModel(
        model_id=resolved.model_id,
        identity=model_identity(resolved.model_id, folder, config),
        path=folder,
        architecture=model_type_of(model),
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        context_length=context_length(config),
        vision=vision,
        vision_note=vision_note,
    )


def _resolve_once(ref: str, cache_dir: Path, dtype: str, progress: ProgressCallback | None,
                  world: "World | None") -> ResolvedModel:
    if world is None:
        return resolve_model(ref, cache_dir, dtype, progress)
    resolved, failure = None, ""
    if world.is_root:
        try:
            resolved = resolve_model(ref, cache_dir, dtype, progress)
        except SemanticError as exc:
            failure = str(exc)
    # The others wait for rank 0's outcome: they find its import in place (hosts sharing a cache
    # directory), or stop with its reason instead of waiting on a rank that gave up.
    failure = world.share(failure)
    if failure:
        raise ModelLoadError(failure if world.is_root else f"rank 0 could not resolve the model: {failure}")
    return resolved or resolve_model(ref, cache_dir, dtype, progress)


def _download_hub_model(repo: str) -> Path:
    """The local snapshot of a hub model, downloading it when the hub is reachable."""
    from mlx_lm.utils import _download

    try:
        return Path(_download(repo))
    except Exception as exc:
        raise ModelLoadError(
            f"model {repo!r} is not a packaged alias, a folder or a .gguf file, and the hub "
            f"could not provide it ({type(exc).__name__}: {exc})"
        ) from exc


def _mlx_load(folder: Path, trust_remote_code: bool) -> tuple[Any, Any, dict[str, Any]]:
    from mlx_lm.utils import load

    try:
        return load(
            str(folder),
            tokenizer_config={"trust_remote_code": trust_remote_code},
            return_config=True,
        )
    except SemanticError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not load model folder {folder}: {type(exc).__name__}: {exc}") from exc


def context_length(config: dict[str, Any]) -> int:
    for source in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return DEFAULT_CONTEXT


def model_identity(name: str, folder: Path | None, config: dict[str, Any]) -> ModelIdentity:
    """Name plus a digest of the config and the weights' fingerprint.

    The fingerprint is the GGUF source hash for imported models, else each
    safetensors file's name, size and header (tensor names, dtypes, offsets):
    cheap to read for any model size, and different whenever the weights file
    is a different export.
    """
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    if folder is not None:
        digest.update(_weights_fingerprint(folder).encode())
    return ModelIdentity(name, digest.hexdigest())


def _weights_fingerprint(folder: Path) -> str:
    data = read_import_marker(folder)
    if data is not None:
        return f"gguf:{data.get('source_sha256')}:{data.get('dtype')}:{data.get('importer_version')}"
    parts = []
    for weights in sorted(folder.glob("*.safetensors")):
        parts.append(f"{weights.name}:{weights.stat().st_size}:{_safetensors_header_hash(weights)}")
    return "|".join(parts)


def _safetensors_header_hash(path: Path) -> str:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return hashlib.sha256(handle.read(min(length, 64 << 20))).hexdigest()[:16]
