"""A vision-language model's vision side, through mlx-vlm (the optional extra ``semantic[vision]``).

The language model is served as every other: mlx-lm loads it from the same folder (dropping the vision
weights), and its layers live in the block pool with every cache kind the text path has. What mlx-vlm adds
is the rest of its own model: the processor (the chat template's image marker expanded into the image's
run of tokens, pixels resized and normalized) and the vision tower with its projector, whose output for an
image is the run's embeddings (mlx-vlm's ``get_input_embeddings`` over the run alone: features scaled as
its language model expects them). Those embeddings replace the run's token embeddings at prefill, which is
exactly what mlx-vlm's own generation feeds its language model (tests/model/test_vision_real.py compares
the tokens).

The mlx-vlm model is loaded lazily and pruned before anything is evaluated: its language layers are
dropped unread and its embedding table is the mlx-lm model's own, so the weights are held once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from engine.errors import ModelLoadError
from engine.models import multimodal_rope

log = logging.getLogger("semantic.models.vision")

# Families whose images this server feeds as mlx-vlm does, checked token for token against mlx-vlm's greedy
# generation (tests/model/test_vision_real.py): Gemma 3, and the families whose rotary positions follow an
# image's grid (multimodal_rope.MROPE_STYLES). Others (tiled images, deepstack features) load as text models
# and say why.
VISION_FAMILIES = ("gemma3", *multimodal_rope.MROPE_STYLES)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True, slots=True)
class VisionModel:
    """What reads images for one loaded model: the processor (any thread) and the pruned mlx-vlm model
    (the engine thread only)."""

    model: Any  # mlx-vlm's model: vision tower, projector, and the mlx-lm model's embedding table
    processor: Any
    model_type: str
    image_token_id: int  # the token the processor writes an image's run with
    marker: str  # what the chat template writes for an image part (the processor expands it)
    add_special_tokens: bool  # whether the processor's tokenization adds BOS itself (mlx-vlm's rule)
    settings_key: str  # a hash of the processor's settings: the same bytes read differently are another image
    # Where an image's tokens take its grid's rows and columns as rotary positions (Qwen-VL's M-RoPE,
    # models/multimodal_rope.py): the vision tower's patches merged into one token a side (0: not such a model).
    merge_size: int = 0

    def grid(self, inputs: dict[str, np.ndarray]) -> tuple[int, int, int] | None:
        """One image's run as the language model's rotary positions see it: (frames, rows, columns) of its
        tokens, for a multi-axis model; None for the others."""
        if not self.merge_size:
            return None
        t, h, w = (int(v) for v in inputs["image_grid_thw"][0])
        return t, h // self.merge_size, w // self.merge_size

    def prepare(self, text: str, images: Sequence[Any]) -> dict[str, np.ndarray]:
        """The processor over a rendered prompt and its PIL images: input_ids with each image's run, and the
        vision tower's inputs (numpy). Runs off the engine thread."""
        from mlx_vlm.utils import prepare_inputs

        inputs = prepare_inputs(self.processor, images=list(images), prompts=text,
                                image_token_index=self.image_token_id, add_special_tokens=self.add_special_tokens,
                                return_tensors="np")
        return {key: np.asarray(value) for key, value in inputs.items() if value is not None}

    def embeddings(self, inputs: dict[str, np.ndarray], length: int) -> Any:
        """One image's run of ``length`` embeddings (length, hidden) from its vision-tower inputs. Engine
        thread: this runs the vision tower."""
        import mlx.core as mx

        arrays = {key: mx.array(value) for key, value in inputs.items()}
        pixels = arrays.pop("pixel_values")
        ids = mx.full((1, length), self.image_token_id, dtype=mx.int32)
        out = self.model.get_input_embeddings(ids, pixels, mask=mx.ones((1, length), dtype=mx.int32), **arrays)
        return out.inputs_embeds[0]


def vision_config_of(folder: Path) -> dict[str, Any] | None:
    config = json.loads((folder / "config.json").read_text())
    return config if isinstance(config.get("vision_config"), dict) else None


def load_vision(folder: Path, text_model: Any) -> tuple[VisionModel | None, str]:
    """The vision side of ``folder``'s model, sharing ``text_model``'s embedding table; (None, why) when the
    model has no vision, mlx-vlm is not installed, or its family is not one this server feeds images to."""
    config = vision_config_of(folder)
    if config is None:
        return None, "it is a text model"
    model_type = str(config.get("model_type", ""))
    if model_type not in VISION_FAMILIES:
        return None, (f"its family ({model_type}) is not one semantic feeds images to yet "
                      f"(supported: {', '.join(VISION_FAMILIES)})")
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return None, "mlx-vlm is not installed: pip install 'semantic[vision]'"
    try:
        return _load(folder, config, text_model), ""
    except Exception as exc:
        raise ModelLoadError(f"could not load the vision side of {folder}: {type(exc).__name__}: {exc}") from exc


def _load(folder: Path, config: dict[str, Any], text_model: Any) -> VisionModel:
    import mlx.core as mx
    from mlx_vlm.utils import load as vlm_load, should_add_special_tokens

    model, processor = vlm_load(str(folder), lazy=True)
    # Held once: the language side is mlx-lm's. Dropped before anything is evaluated, so never read.
    language = model.language_model.model
    language.embed_tokens = embedding_table(text_model)
    language.layers = []
    if hasattr(model.language_model, "lm_head"):
        model.language_model.lm_head = None
    mx.eval(model.parameters())
    image_token_id = int(config.get("image_token_index") or config.get("image_token_id"))
    model_type = str(config["model_type"])
    merge_size = 0
    if model_type in multimodal_rope.MROPE_STYLES:  # the language model's rotary positions follow an image's grid
        multimodal_rope.install(text_model, config.get("text_config") or config,
                                multimodal_rope.MROPE_STYLES[model_type])
        merge_size = int(config["vision_config"].get("spatial_merge_size", 2))
    return VisionModel(
        model=model, processor=processor, model_type=model_type, image_token_id=image_token_id,
        marker=image_marker(processor), add_special_tokens=should_add_special_tokens(model_type, processor),
        settings_key=_settings_key(folder), merge_size=merge_size,
    )


def embedding_table(model: Any) -> Any:
    """The token embedding module of an mlx-lm model (``...embed_tokens``)."""
    for name, module in model.named_modules():
        if name.endswith("embed_tokens"):
            return module
    raise ModelLoadError("the language model has no embed_tokens module to feed image features through")


def image_marker(processor: Any) -> str:
    """What the processor's chat template writes for an image part: rendered with one and without."""
    templater = processor if getattr(processor, "chat_template", None) else processor.tokenizer

    def rendered(content: list[dict[str, Any]]) -> str:
        return templater.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=False)

    text = [{"type": "text", "text": "\ue000"}]
    with_image, without = rendered([{"type": "image"}, *text]), rendered(text)
    at = without.index("\ue000")
    marker = with_image[at:with_image.index("\ue000", at)]
    if not marker or with_image[:at] != without[:at]:
        raise ModelLoadError("the chat template writes no image marker for an image part")
    return marker


def _settings_key(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in PROCESSOR_FILES:
        path = folder / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]
