"""How a model samples when a request names no temperature.

Clients such as Claude Code send no temperature and expect the server's
default, as with any hosted model. Greedy decoding is the wrong default for
small local models: at temperature 0 they fall into loops (SmolLM2 answered
"Name one colour." with 4,543 tokens of one repeated sentence). So the
defaults are the model's own, from ``generation_config.json`` in its folder
(``temperature``, ``top_p``, ``top_k``; ``do_sample: false`` means greedy);
for a packaged GGUF without one, the values its model card recommends
(``PackagedModel.card_sampling``); otherwise the fallback below, the usual
local-server choice. Settings can override each value.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.gguf_import import read_import_marker
from engine.models.packaged import PACKAGED_MODELS, PackagedModel, find_packaged_model
from engine.domain.requests import SamplingParams

log = logging.getLogger("semantic.models")

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    temperature: float
    top_p: float
    top_k: int
    source: str  # where the values came from, for the log, /v1/stats and the workbench

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def describe(self) -> str:
        if self.temperature == 0:
            return f"greedy ({self.source})"
        top_k = f", top_k {self.top_k}" if self.top_k else ""
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}{top_k} ({self.source})"

    def with_overrides(self, temperature: float | None, top_p: float | None, top_k: int | None) -> "SamplingDefaults":
        if temperature is None and top_p is None and top_k is None:
            return self
        return SamplingDefaults(
            self.temperature if temperature is None else temperature,
            self.top_p if top_p is None else top_p,
            self.top_k if top_k is None else top_k,
            f"{self.source}, overridden by settings",
        )


# llama.cpp's and Ollama's defaults, a little cooler: small models drift at higher temperatures.
FALLBACK = SamplingDefaults(temperature=0.7, top_p=0.95, top_k=40, source="fallback: no generation_config.json")


def model_sampling_defaults(model_id: str, folder: Path | None) -> SamplingDefaults:
    """What a loaded model samples with: its folder's config, else its model card, else :data:`FALLBACK`."""
    return read_sampling_defaults(folder, packaged_card_defaults(model_id, folder))


def packaged_card_defaults(model_id: str, folder: Path | None = None) -> SamplingDefaults | None:
    """The model card's sampling for a packaged model (its GGUF has no generation_config.json).

    The model is found by its alias, or, for a folder passed by path, by the GGUF its import came from.
    """
    model = find_packaged_model(model_id) or _imported_from_packaged(folder)
    if model is None or model.card_sampling is None:
        return None
    temperature, top_p, top_k = model.card_sampling
    return SamplingDefaults(temperature, top_p, top_k, f"{model.display_name} model card")


def _imported_from_packaged(folder: Path | None) -> PackagedModel | None:
    try:
        marker = read_import_marker(folder) if folder is not None else None
    except (OSError, ValueError):
        return None
    if marker is None:
        return None
    source = Path(str(marker.get("source_path", ""))).name
    return next((m for m in PACKAGED_MODELS if m.gguf_file_name == source), None)


def read_sampling_defaults(folder: Path | None, fallback: SamplingDefaults | None = None) -> SamplingDefaults:
    """The model folder's sampling defaults, else ``fallback``, else :data:`FALLBACK`."""
    fallback = fallback or FALLBACK
    path = folder / GENERATION_CONFIG if folder is not None else None
    if path is None or not path.is_file():
        return fallback
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return fallback
    return _from_config(config, fallback) if isinstance(config, dict) else fallback


def _from_config(config: dict[str, Any], fallback: SamplingDefaults) -> SamplingDefaults:
    if config.get("do_sample") is False:
        return SamplingDefaults(0.0, 1.0, 0, f"{GENERATION_CONFIG}: do_sample false")
    keys = ("temperature", "top_p", "top_k")
    if not any(k in config for k in keys):
        return fallback
    temperature = _number(config.get("temperature"), FALLBACK.temperature, 0.0, 2.0)
    top_p = _number(config.get("top_p"), 1.0, 1e-6, 1.0)
    top_k = int(_number(config.get("top_k"), 0, 0, 1e9))
    return SamplingDefaults(temperature, top_p, top_k, GENERATION_CONFIG)


def _number(value: Any, default: float, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return min(max(float(value), low), high)
