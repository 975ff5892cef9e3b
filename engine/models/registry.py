"""The models a user can switch between: packaged, imported, named folders and hub ids.

Entries describe what is known without loading weights: where the model is,
whether it is present locally, its size, its architecture and an estimate of
its KV layout read from config.json. The loaded model's entry carries the
exact cache spec.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.models.packaged import PACKAGED_MODELS, PackagedModel, find_packaged_model

# Claude Code (and other Anthropic clients) name Anthropic models; they all
# mean "whatever is loaded here".
LOADED_MODEL_PATTERNS = ("claude", "haiku", "sonnet", "opus")


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    model_id: str
    kind: str  # "packaged", "imported", "folder", "hub"
    location: str  # alias, folder path or hub id: what load_model accepts
    aliases: tuple[str, ...] = ()
    present: bool = False
    size_bytes: int | None = None
    architecture: str | None = None
    cache_spec: dict[str, Any] | None = None
    spec_is_exact: bool = False
    loaded: bool = False
    description: str = ""

    def answers_to(self, name: str) -> bool:
        wanted = name.casefold()
        return wanted in {n.casefold() for n in (self.model_id, self.location, *self.aliases)}


# The listing reads the models folder; it is served from memory for this long (a palette keystroke,
# a /v1/models poll) and rebuilt off the hot paths.
LISTING_TTL_S = 5.0


@dataclass(slots=True)
class ModelRegistry:
    models_dir: Path
    _extra: dict[str, RegistryEntry] = field(default_factory=dict)
    _loaded: RegistryEntry | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _listing: tuple[float, list[RegistryEntry]] | None = None

    # -- listing ---------------------------------------------------------------------------
    def entries(self) -> list[RegistryEntry]:
        """Every model; read from disk at most every LISTING_TTL_S seconds."""
        cached = self._listing
        if cached is not None and time.monotonic() - cached[0] < LISTING_TTL_S:
            return [self._mark_loaded(e) for e in cached[1]]
        with self._lock:
            found = [self._packaged(p) for p in PACKAGED_MODELS]
            found += self._imported(exclude={e.location for e in found})
            found += [e for e in self._extra.values() if not any(e.location == f.location for f in found)]
            self._listing = (time.monotonic(), found)
        return [self._mark_loaded(e) for e in found]

    def _forget_listing(self) -> None:
        self._listing = None

    def find(self, name: str) -> RegistryEntry | None:
        for entry in self.entries():
            if entry.answers_to(name):
                return entry
        return None

    def resolve_request_model(self, name: str | None) -> RegistryEntry | None:
        """What a request's ``model`` field names: a known entry, the loaded model, or nothing."""
        if not name:
            return self._loaded
        entry = self.find(name)
        if entry is not None:
            return entry
        if any(p in name.casefold() for p in LOADED_MODEL_PATTERNS):
            return self._loaded
        return None

    # -- updates ---------------------------------------------------------------------------------
    def add(self, ref: str) -> RegistryEntry:
        """Remember a folder or hub id the user named (so it is listed and can be swapped to)."""
        entry = self.find(ref) or _describe_ref(ref)
        with self._lock:
            if entry.kind in ("folder", "hub"):
                self._extra[entry.location] = entry
        self._forget_listing()
        return entry

    def set_loaded(self, ref: str, model_id: str, architecture: str, spec: dict[str, Any], path: Path | None) -> None:
        base = self.find(model_id) or self._find_quietly(ref)
        if base is None or base.model_id != model_id:
            base = RegistryEntry(model_id, "folder", str(path) if path else ref)
        with self._lock:
            self._loaded = replace(
                base, architecture=architecture, cache_spec=spec, spec_is_exact=True, present=True, loaded=True,
                size_bytes=base.size_bytes or (_folder_size(path) if path else None),
            )
            if base.kind in ("folder", "hub"):
                self._extra[base.location] = self._loaded
        self._forget_listing()

    def _find_quietly(self, ref: str) -> RegistryEntry | None:
        try:
            return self.find(ref)
        except ModelLoadError:
            return None

    @property
    def loaded(self) -> RegistryEntry | None:
        return self._loaded

    # -- entry builders ---------------------------------------------------------------------------------
    def _packaged(self, model: PackagedModel) -> RegistryEntry:
        imported = self._imported_folder_for(model)
        config = _config(imported) if imported else {}
        return RegistryEntry(
            model_id=model.alias, kind="packaged", location=model.alias, aliases=model.other_names,
            present=_package_present(model), size_bytes=_folder_size(imported) if imported else None,
            architecture=config.get("model_type"), cache_spec=_estimated_spec(config) if config else None,
            description=f"{model.display_name} — {model.description} Install: {model.install_command}",
        )

    def _imported(self, exclude: set[str]) -> list[RegistryEntry]:
        entries = []
        for folder in sorted(self.models_dir.glob("*")) if self.models_dir.is_dir() else []:
            if not (folder / "config.json").is_file() or folder.name.startswith("."):
                continue
            if self._belongs_to_packaged(folder):
                continue
            config = _config(folder)
            entries.append(RegistryEntry(
                model_id=folder.name, kind="imported", location=str(folder), present=True,
                size_bytes=_folder_size(folder), architecture=config.get("model_type"),
                cache_spec=_estimated_spec(config), description="imported GGUF",
            ))
        return [e for e in entries if e.location not in exclude]

    def _imported_folder_for(self, model: PackagedModel) -> Path | None:
        # The importer names folders <slug of the GGUF stem>-<dtype>-<hash>.
        stem = re.sub(r"[^a-z0-9]+", "-", Path(model.gguf_file_name).stem.lower()).strip("-") + "-"
        for folder in sorted(self.models_dir.glob("*")) if self.models_dir.is_dir() else []:
            if folder.name.startswith(stem) and (folder / "config.json").is_file():
                return folder
        return None

    def _belongs_to_packaged(self, folder: Path) -> bool:
        return any(self._imported_folder_for(p) == folder for p in PACKAGED_MODELS)

    def _mark_loaded(self, entry: RegistryEntry) -> RegistryEntry:
        loaded = self._loaded
        if loaded is not None and (entry.location == loaded.location or entry.model_id == loaded.model_id):
            return loaded
        return replace(entry, loaded=False) if entry.loaded else entry


def _describe_ref(ref: str) -> RegistryEntry:
    packaged = find_packaged_model(ref)
    if packaged is not None:
        return RegistryEntry(packaged.alias, "packaged", packaged.alias, packaged.other_names, _package_present(packaged))
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but not an MLX model folder: it has no config.json")
        config = _config(path)
        return RegistryEntry(path.name, "folder", str(path.resolve()), present=True,
                             size_bytes=_folder_size(path), architecture=config.get("model_type"),
                             cache_spec=_estimated_spec(config) if config else None)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"{path} is not a file: a .gguf model must exist")
        return RegistryEntry(path.stem, "folder", str(path), present=True,
                             size_bytes=path.stat().st_size if path.is_file() else None, description="GGUF file")
    if ref.startswith((".", "/", "~")):
        raise ModelLoadError(f"model {ref!r} not found")
    return RegistryEntry(ref, "hub", ref, present=False, description="hub id (downloaded on first load)")


def _package_present(model: PackagedModel) -> bool:
    import importlib.util

    return importlib.util.find_spec(model.module) is not None


def _config(folder: Path | None) -> dict[str, Any]:
    if folder is None:
        return {}
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


# A model folder is flat (config, weights, tokenizer files); never walk more than this of one.
MAX_FOLDER_ENTRIES = 2000


def _folder_size(folder: Path | None) -> int | None:
    """Bytes of the files directly in a model folder (no descent: a user may name "/")."""
    if folder is None or not folder.is_dir():
        return None
    total = 0
    try:
        with os.scandir(folder) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_FOLDER_ENTRIES:
                    break
                with suppress(OSError):
                    if entry.is_file(follow_symlinks=True):
                        total += entry.stat().st_size
    except OSError:
        return None
    return total


def _estimated_spec(config: dict[str, Any]) -> dict[str, Any] | None:
    """KV layout from config.json alone (exact only once the model is loaded)."""
    source = config.get("text_config") or config
    layers = source.get("num_hidden_layers")
    heads = source.get("num_attention_heads")
    if not layers or not heads:
        return None
    kv_heads = source.get("num_key_value_heads", heads)
    head_dim = source.get("head_dim") or (source.get("hidden_size", 0) // heads)
    window = source.get("sliding_window")
    pattern = source.get("sliding_window_pattern")
    return {"n_layers": layers, "n_kv_heads": kv_heads, "head_dim": head_dim,
            "sliding_window": window if pattern else None, "estimated": True}
