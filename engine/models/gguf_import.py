"""Import a GGUF file into an ordinary MLX model folder, as ``mlx_lm.load`` and its server read.

Every tensor is dequantized with ``gguf.quants.dequantize`` into one float dtype: on the CPU
backend float32 weights decode ~3x faster than MLX's quantized matmul, and the K-quants that
llama.cpp favours have no MLX counterpart anyway.

Caching: the folder name ends in a short hash of the source's size, mtime and file name plus the
importer version and dtype, so finding an earlier import costs one ``stat`` instead of hashing
gigabytes. The content SHA-256, computed once during the import, is recorded in
``semantic_import.json`` for provenance. A new ``IMPORTER_VERSION`` re-imports everything.

Atomicity: the folder is built under a ``.importing-<pid>-*`` directory in ``models_dir`` and
renamed into place, with ``semantic_import.json`` written last, so a crash never leaves a folder
under the final name; leftovers of dead processes are removed by the next import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx

from engine.errors import ModelLoadError
from engine.models.gguf_architectures import ArchitectureSpec, architecture_spec, check_tensors
from engine.models.gguf_metadata import GGUFFile
from engine.models.gguf_tokenizer import TokenizerFiles, rebuild_tokenizer

IMPORTER_VERSION = 1
MARKER_FILE = "semantic_import.json"
WEIGHTS_FILE = "model.safetensors"
TEMP_PREFIX = ".importing-"
SUPPORTED_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}
_HASH_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ImportProgress:
    """One progress report.

    Stages in order: hashing (done/total in bytes), reading, tensors (done/total in tensors),
    tokenizer, writing; the last three report 0/1 then 1/1. Starting an engine adds loading (the
    weights) and, on the CPU, compiling (its compiled loops loaded, of all; runner/backends/cpu).
    """

    stage: str
    done: int
    total: int


ProgressCallback = Callable[[ImportProgress], None]


def default_import_dtype() -> str:
    """float32 on the CPU backend (its fastest matmul), bfloat16 on GPU backends (half the size)."""
    return "float32" if mx.default_device().type == mx.cpu else "bfloat16"


def import_gguf(
    gguf_path: Path,
    models_dir: Path,
    dtype: str = "float32",
    progress: ProgressCallback | None = None,
) -> Path:
    """The MLX model folder for ``gguf_path`` under ``models_dir``, imported unless already there.

    ``dtype`` is float32, bfloat16, float16 or ``auto`` (``default_import_dtype()``). Raises
    ``UnsupportedModelError`` for architectures, tensor types or tokenizers the importer does not
    handle and ``ModelLoadError`` for missing or unreadable files.
    """
    source = Path(gguf_path).expanduser().resolve()
    dtype = _check_dtype(default_import_dtype() if dtype == "auto" else dtype)
    if not source.is_file():
        raise ModelLoadError(f"GGUF file {source} does not exist")
    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / import_folder_name(source, dtype)
    if is_complete_import(target):
        return target
    _remove_stale_temp_dirs(models_dir)
    _discard_incomplete(target)
    report = progress or _ignore_progress
    build_dir = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", dir=models_dir))
    try:
        _build_model_folder(source, build_dir, dtype, report)
        return _publish(build_dir, target)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def import_folder_name(source: Path, dtype: str) -> str:
    """``<file stem slug>-<dtype>-<hash>``: readable, distinct per source and importer version."""
    stat = source.stat()
    fingerprint = f"{source.name}|{stat.st_size}|{stat.st_mtime_ns}|{IMPORTER_VERSION}|{dtype}"
    short_hash = hashlib.sha256(fingerprint.encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9]+", "-", source.stem.lower()).strip("-") or "model"
    return f"{slug}-{dtype}-{short_hash}"


def read_import_marker(folder: Path) -> dict[str, Any] | None:
    """The provenance an import wrote into ``folder``; None when it is no import. Raises OSError or
    ValueError when the marker is unreadable or not a JSON object."""
    path = folder / MARKER_FILE
    if not path.is_file():
        return None
    marker = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(marker, dict):
        raise ValueError(f"{path} is not a JSON object")
    return marker


def is_complete_import(folder: Path) -> bool:
    """True when ``folder`` has a marker of this importer version and every file it lists."""
    try:
        marker = read_import_marker(folder)
    except (OSError, ValueError):
        return False
    if marker is None:
        return False
    if marker.get("importer_version") != IMPORTER_VERSION:
        return False
    return all((folder / name).is_file() for name in marker.get("files", []))


def _build_model_folder(source: Path, folder: Path, dtype: str, report: ProgressCallback) -> None:
    source_sha256 = _sha256_with_progress(source, report)
    report(ImportProgress("reading", 0, 1))
    gguf_file = GGUFFile(source)
    spec = architecture_spec(gguf_file)
    check_tensors(gguf_file, spec)
    report(ImportProgress("reading", 1, 1))
    weights = _dequantized_weights(gguf_file, spec, SUPPORTED_DTYPES[dtype], report)
    report(ImportProgress("tokenizer", 0, 1))
    tokenizer_files = rebuild_tokenizer(gguf_file)
    report(ImportProgress("tokenizer", 1, 1))
    report(ImportProgress("writing", 0, 1))
    config = _model_config(gguf_file, spec, weights, dtype)
    written = _write_model_files(folder, config, weights, tokenizer_files)
    marker = _marker(source, source_sha256, gguf_file, spec, dtype, written)
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    report(ImportProgress("writing", 1, 1))


def _dequantized_weights(
    gguf_file: GGUFFile, spec: ArchitectureSpec, dtype: mx.Dtype, report: ProgressCallback
) -> dict[str, mx.array]:
    tensors = gguf_file.tensors
    weights: dict[str, mx.array] = {}
    for done, tensor in enumerate(tensors):
        report(ImportProgress("tensors", done, len(tensors)))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        expected_shape = tuple(int(n) for n in reversed(tensor.shape))
        if values.shape != expected_shape:
            raise ModelLoadError(
                f"{gguf_file.path.name}: tensor {tensor.name!r} dequantized to shape "
                f"{values.shape}, expected {expected_shape}"
            )
        weight = mx.array(spec.fix_weight(tensor.name, values)).astype(dtype)
        # Evaluate now so each float32 temporary is freed before the next tensor is dequantized.
        mx.eval(weight)
        weights[spec.mlx_name(tensor.name)] = weight
    report(ImportProgress("tensors", len(tensors), len(tensors)))
    return weights


def _model_config(
    gguf_file: GGUFFile, spec: ArchitectureSpec, weights: dict[str, mx.array], dtype: str
) -> dict[str, Any]:
    # The embedding's row count is authoritative: the vocab_size key is optional in GGUF.
    vocab_size = int(weights["model.embed_tokens.weight"].shape[0])
    config = spec.build_config(gguf_file, vocab_size)
    config["torch_dtype"] = dtype
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        token_id = gguf_file.value(f"tokenizer.ggml.{key}", None)
        if token_id is not None:
            config[name] = int(token_id)
    eot_id = gguf_file.value("tokenizer.ggml.eot_token_id", None)
    if eot_id is not None and eot_id != config.get("eos_token_id"):
        # End-of-turn ends a chat reply just as EOS does; mlx-lm stops on any id in the list.
        config["eos_token_id"] = [config["eos_token_id"], int(eot_id)]
    return config


def _write_model_files(
    folder: Path,
    config: dict[str, Any],
    weights: dict[str, mx.array],
    tokenizer_files: TokenizerFiles,
) -> list[str]:
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    mx.save_safetensors(str(folder / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    return ["config.json", WEIGHTS_FILE, *tokenizer_files.write(folder)]


def _marker(
    source: Path,
    source_sha256: str,
    gguf_file: GGUFFile,
    spec: ArchitectureSpec,
    dtype: str,
    files: list[str],
) -> dict[str, Any]:
    stat = source.stat()
    return {
        "importer_version": IMPORTER_VERSION,
        "source_path": str(source),
        "source_sha256": source_sha256,
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
        "model_name": gguf_file.model_name,
        "gguf_architecture": spec.gguf_name,
        "model_type": spec.model_type,
        "dtype": dtype,
        "files": files,
    }


def _sha256_with_progress(source: Path, report: ProgressCallback) -> str:
    total = source.stat().st_size
    digest = hashlib.sha256()
    done = 0
    report(ImportProgress("hashing", 0, total))
    with source.open("rb") as stream:
        while chunk := stream.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
            done += len(chunk)
            report(ImportProgress("hashing", done, total))
    return digest.hexdigest()


def _publish(build_dir: Path, target: Path) -> Path:
    # mkdtemp made the build directory private (0700); the published folder is ordinary.
    os.chmod(build_dir, 0o755)
    try:
        os.rename(build_dir, target)
    except OSError:
        # Another process published the same import first; its folder is as good as ours.
        if is_complete_import(target):
            return target
        raise
    return target


def _discard_incomplete(target: Path) -> None:
    # Only a rename creates the final name, so a folder there without a valid marker was made by
    # someone else or by an older importer; move it aside first so the delete cannot race a reader.
    if not target.exists():
        return
    doomed = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", dir=target.parent))
    os.rename(target, doomed / target.name)
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_stale_temp_dirs(models_dir: Path) -> None:
    for candidate in models_dir.glob(f"{TEMP_PREFIX}*"):
        owner = _owner_pid(candidate.name)
        if candidate.is_dir() and (owner is None or not _process_alive(owner)):
            shutil.rmtree(candidate, ignore_errors=True)


def _owner_pid(temp_name: str) -> int | None:
    match = re.match(rf"^{re.escape(TEMP_PREFIX)}(\d+)-", temp_name)
    return int(match.group(1)) if match else None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_dtype(dtype: str) -> str:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"dtype {dtype!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)} or auto"
        )
    return dtype


def _ignore_progress(_: ImportProgress) -> None:
    return None
