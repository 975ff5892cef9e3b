"""A model that is loaded and ready to serve, plus its identity."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.domain.cache_spec import ModelCacheSpec
from engine.domain.reasoning import ReasoningFormat
from engine.models.reasoning_format import reasoning_format

if TYPE_CHECKING:
    from engine.models.vision import VisionModel


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """Names a model's weights exactly: caches made by one never serve another.

    ``digest`` hashes the config and the weights' fingerprint (the GGUF
    source hash for imports; file names, sizes and mtimes otherwise).
    """

    name: str
    digest: str

    @property
    def key(self) -> str:
        return f"{self.name}@{self.digest[:16]}"


@dataclass(frozen=True, slots=True)
class DraftModel:
    """A loaded draft model (models/draft_model.py loads and checks it): what proposes tokens, and the name
    users gave it."""

    model_id: str
    model: Any  # mlx.nn.Module with the served model's token numbering
    # The whole load it came from, when an extra model (--extra-model) is the draft: that model's engine
    # serves with these very weights, so they are held once (bootstrap.slot_engine_builder).
    loaded: "LoadedModel | None" = None


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model_id: str  # what users call it: alias, folder name or hub id
    identity: ModelIdentity
    path: Path | None
    architecture: str
    model: Any  # mlx.nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    spec: ModelCacheSpec
    context_length: int
    # The draft model for --speculate draft, loaded beside this one (None: no draft model).
    draft: DraftModel | None = None
    # How the model marks its reasoning (models/reasoning_format.py); read from the tokenizer when not given.
    reasoning: ReasoningFormat | None = None
    # What reads images (models/vision.py); None for a model without vision, ``vision_note`` saying why.
    vision: "VisionModel | None" = None
    vision_note: str = "it is a text model"

    def __post_init__(self) -> None:
        if self.reasoning is None:
            object.__setattr__(self, "reasoning", reasoning_format(self.tokenizer))

    @property
    def shard(self) -> tuple[int, int] | None:
        """(rank, world size) when this process holds one shard of the model."""
        return self.spec.shard

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)
