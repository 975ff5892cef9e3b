"""Random-weight vision-language model folders, built from mlx-vlm's own model classes.

A folder holds what a converted checkpoint holds (config.json, safetensors, tokenizer, chat template,
processor and image-processor configs), so ``mlx_vlm.load``, ``mlx_lm.load``, ``mlx_vlm.server`` and
semantic all read it as they read a real one. The tokenizer is SmolLM2's (installed here) with the
family's image tokens added; the chat template is SmolLM2's ChatML with the family's image marker for
image parts. Two sizes: ``TINY`` for tests (a vision tower of two layers over 4x4 patches), ``BENCH``
for bench/bench_vision.py (Gemma 3 270M's text shape, a SigLIP-B-like tower over 448-pixel images, 256
soft tokens an image, as Gemma 3 writes them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

# ChatML, as SmolLM2 writes it, with image parts rendered as the family's marker (``{image}``).
CHATML_WITH_IMAGES = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{image}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                       "eoi_token": "<end_of_image>"}


def _tokenizer_with(folder: Path, tokenizer_source: Path, extra: dict[str, str], image_marker: str) -> dict[str, int]:
    """SmolLM2's tokenizer plus ``extra``'s special tokens (saved into ``folder``); their ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    tokenizer.add_special_tokens({"additional_special_tokens": list(extra.values())})
    tokenizer.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["extra_special_tokens"] = dict(extra)
    config["chat_template"] = CHATML_WITH_IMAGES.replace("{image}", image_marker)
    config_path.write_text(json.dumps(config, indent=1))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return {name: tokenizer.convert_tokens_to_ids(token) for name, token in extra.items()}


@dataclass(frozen=True, slots=True)
class VlmSize:
    text: dict[str, Any]
    vision: dict[str, Any]
    tokens_per_image: int


TINY = VlmSize(
    text={"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32,
          "sliding_window_pattern": 2},
    vision={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "image_size": 56},
    tokens_per_image=4)
BENCH = VlmSize(
    text={"hidden_size": 640, "num_hidden_layers": 18, "intermediate_size": 2048, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
          "sliding_window_pattern": 6},
    vision={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
            "image_size": 448},
    tokens_per_image=256)


def gemma3_vlm(folder: Path, tokenizer_source: Path, seed: int = 0, size: VlmSize = TINY) -> Path:
    """A Gemma 3 vision-language model: SigLIP tower (patches of 14), the pooling projector
    (``size.tokens_per_image`` soft tokens an image), Gemma 3 text layers with sliding and global attention."""
    tokens_per_image, image_size = size.tokens_per_image, size.vision["image_size"]
    from mlx_vlm.models import gemma3
    from mlx.utils import tree_flatten

    folder.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer_with(folder, tokenizer_source, GEMMA3_IMAGE_TOKENS, GEMMA3_IMAGE_TOKENS["boi_token"])
    vocab = max(ids.values()) + 1
    eos = json.loads((tokenizer_source / "config.json").read_text()).get("eos_token_id", 2)
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": ids["image_token"],
        "boi_token_index": ids["boi_token"],
        "eoi_token_index": ids["eoi_token"],
        "mm_tokens_per_image": tokens_per_image,
        "hidden_size": size.text["hidden_size"],
        "pad_token_id": 0,
        "eos_token_id": [eos] if isinstance(eos, int) else eos,
        "vocab_size": vocab,
        "text_config": {
            "model_type": "gemma3_text", **size.text, "vocab_size": vocab, "mm_tokens_per_image": tokens_per_image,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", **size.vision, "patch_size": 14, "num_channels": 3,
            "layer_norm_eps": 1e-6,
        },
    }
    mx.random.seed(seed)
    model_config = gemma3.ModelConfig.from_dict(config)
    model_config.text_config = gemma3.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = gemma3.VisionConfig.from_dict(config["vision_config"])
    model = gemma3.Model(model_config)
    # mlx-vlm starts the projector's matrix at ones (a checkpoint overwrites it): every hidden unit of an image's
    # embeddings would be the same near-zero sum, which no picture changes. Random, of unit scale, as trained.
    projector = model.multi_modal_projector
    rows = projector.mm_input_projection_weight.shape[0]
    projector.mm_input_projection_weight = mx.random.normal(projector.mm_input_projection_weight.shape) / rows**0.5
    mx.eval(model.parameters())
    # Gemma 3 ties its output head to the embeddings: a converted checkpoint has no lm_head.
    weights = {k: v for k, v in tree_flatten(model.parameters()) if not k.endswith("lm_head.weight")}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": tokens_per_image}))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": image_size, "width": image_size}, "do_resize": True, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True, "do_pan_and_scan": False,
    }))
    return folder


QWEN2_VL_IMAGE_TOKENS = {"vision_start": "<|vision_start|>", "image_pad": "<|image_pad|>",
                         "vision_end": "<|vision_end|>", "video_pad": "<|video_pad|>"}
QWEN2_VL_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True, slots=True)
class QwenVlSize:
    text: dict[str, dict[str, Any]]  # per family: the language model's shape (Qwen3.5's: its text_config)
    vision: dict[str, dict[str, Any]]  # per family: the vision tower's shape
    max_pixels: int  # the processor resizes larger pictures down to this many pixels


_QWEN2_TINY_TEXT = {"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
# Qwen3.5's language model: gated-delta layers with a full-attention layer every second one, whose rotary
# embedding covers half of each head in interleaved sections.
_QWEN3_5_TINY_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 2,
    "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                        "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}}
_QWEN3_5_TINY_TOWER = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": []}
QWEN_VL_TINY = QwenVlSize(
    text={"qwen2_vl": _QWEN2_TINY_TEXT, "qwen2_5_vl": _QWEN2_TINY_TEXT, "qwen3_5": _QWEN3_5_TINY_TEXT,
          # Qwen3.5's mixture of experts: the same layers with a routed MLP of 4 experts (2 a token) and a shared one
          "qwen3_5_moe": {**_QWEN3_5_TINY_TEXT, "model_type": "qwen3_5_moe_text", "num_experts": 4,
                          "num_experts_per_tok": 2, "shared_expert_intermediate_size": 64, "moe_intermediate_size": 32,
                          "decoder_sparse_step": 1, "norm_topk_prob": True}},
    vision={"qwen2_vl": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2},
            # Qwen2.5-VL's tower: windowed attention (56-pixel windows) but in its last block
            "qwen2_5_vl": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                           "window_size": 56, "fullatt_block_indexes": [1]},
            # Qwen3.5's tower: 16-pixel patches with learned position embeddings, no deepstack
            "qwen3_5": _QWEN3_5_TINY_TOWER, "qwen3_5_moe": _QWEN3_5_TINY_TOWER},
    max_pixels=28 * 28 * 16)
# For bench/bench_vision.py: Qwen3.5's layer pattern (three gated-delta layers to one of full attention, a
# quarter of each head rotated) at about the Gemma bench's text scale, a 12-layer tower of ViT-B's width over
# 16-pixel patches, screenshots resized to at most 448x448 pixels' worth (a 1280x800 one: 22x14 tokens).
QWEN3_5_BENCH = QwenVlSize(
    text={"qwen3_5": {**_QWEN3_5_TINY_TEXT, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 16,
                      "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
                      "linear_num_value_heads": 8, "linear_num_key_heads": 4, "linear_key_head_dim": 64,
                      "linear_value_head_dim": 64, "full_attention_interval": 4,
                      "rope_parameters": {"rope_type": "default", "mrope_section": [6, 5, 5],
                                          "mrope_interleaved": True, "rope_theta": 1000000.0,
                                          "partial_rotary_factor": 0.25}}},
    vision={"qwen3_5": {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12,
                        "num_position_embeddings": 2304, "deepstack_visual_indexes": []}},
    max_pixels=448 * 448)
QWEN_VL_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                   "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                   "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def qwen_vl_vlm(folder: Path, tokenizer_source: Path, family: str = "qwen2_vl", seed: int = 0,
                size: QwenVlSize = QWEN_VL_TINY) -> Path:
    """A Qwen2-VL, Qwen2.5-VL or Qwen3.5 vision-language model: its ViT over 14-pixel patches (16 for Qwen3.5),
    2x2 merged into one token, so an image's run follows its aspect (84x56 pixels is 3x2 tokens); text layers
    whose rotary positions are multi-axis (M-RoPE: an image's tokens take its grid's rows and columns)."""
    import importlib

    from mlx.utils import tree_flatten

    classes = importlib.import_module(f"mlx_vlm.models.{family}")
    folder.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer_with(folder, tokenizer_source, QWEN2_VL_IMAGE_TOKENS, QWEN2_VL_MARKER)
    vocab = max(ids.values()) + 1
    eos = json.loads((tokenizer_source / "config.json").read_text()).get("eos_token_id", 2)
    hidden = size.text[family]["hidden_size"]
    qwen3_5 = family.startswith("qwen3_5")
    patch = 16 if qwen3_5 else 14
    vision = {"model_type": family, **size.vision[family], "patch_size": patch, "spatial_patch_size": patch,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3, "in_channels": 3}
    vision["hidden_size" if family == "qwen2_vl" else "out_hidden_size"] = hidden
    config = {
        "model_type": family,
        "architectures": [QWEN_VL_CLASSES[family]],
        "image_token_id": ids["image_pad"],
        "video_token_id": ids["video_pad"],
        "vision_start_token_id": ids["vision_start"],
        "vision_end_token_id": ids["vision_end"],
        **(size.text[family] if not family.startswith("qwen3_5") else {}),
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "vocab_size": vocab,
        "eos_token_id": eos if isinstance(eos, int) else eos[0],
        "vision_config": vision,
    }
    if qwen3_5:  # the text model's settings nest under text_config
        config = {key: value for key, value in config.items() if key not in (
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings")}
        config["text_config"] = {**size.text[family], "vocab_size": vocab, "eos_token_id": config["eos_token_id"]}
    mx.random.seed(seed)
    model_config = classes.ModelConfig.from_dict(dict(config))
    if isinstance(model_config.text_config, dict):
        model_config.text_config = classes.TextConfig.from_dict(model_config.text_config)
    if isinstance(model_config.vision_config, dict):
        model_config.vision_config = classes.VisionConfig.from_dict(vision)
    model = classes.Model(model_config)
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"
        if family == "qwen2_vl" else "Qwen2_5_VLProcessor",
        "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": (2 * patch) ** 2,
        "max_pixels": size.max_pixels, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }))
    return folder
