"""What each supported GGUF architecture becomes in mlx-lm: config, tensor names, weight fix-ups.

llama.cpp writes hyperparameters under ``<architecture>.*`` keys and tensors under its own names
(``blk.N.attn_q.weight``); mlx-lm expects a Hugging Face style config and parameter names. Each
``ArchitectureSpec`` below holds that translation for one architecture; adding one is adding a spec.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from engine.errors import UnsupportedModelError
from engine.models.gguf_metadata import GGUFFile

Q = gguf.GGMLQuantizationType

# Types the importer dequantizes with ``gguf.quants.dequantize``: plain floats, the legacy block
# quants and the K-quants, which cover the GGUF files people commonly run.
SUPPORTED_TENSOR_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(
    {
        Q.F32, Q.F16, Q.BF16,
        Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
        Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    }
)  # fmt: skip

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LLAMA_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Gemma 3 wraps both attention and MLP in pre- and post-norms; llama.cpp's names for them differ
# from llama's meaning (its ``ffn_norm`` is Gemma's *pre*-feedforward norm).
_GEMMA3_BLOCK_TENSORS = {
    **_LLAMA_BLOCK_TENSORS,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one ``general.architecture`` maps onto an mlx-lm model type."""

    gguf_name: str
    model_type: str
    block_tensors: dict[str, str]
    build_config: Callable[[GGUFFile, int], dict[str, Any]]
    fix_weight: Callable[[str, np.ndarray], np.ndarray]
    allows_bias: bool

    def mlx_name(self, gguf_name: str) -> str | None:
        """The mlx-lm name of a GGUF tensor, or None when this architecture has no such tensor."""
        if match := _BLOCK_NAME.match(gguf_name):
            layer, part, kind = match.groups()
            target = self.block_tensors.get(part)
            if target is None or (kind == "bias" and not self.allows_bias):
                return None
            return f"model.layers.{layer}.{target}.{kind}"
        if match := _GLOBAL_NAME.match(gguf_name):
            part, kind = match.groups()
            target = _GLOBAL_TENSORS.get(part)
            return f"{target}.{kind}" if target else None
        return None


def _unchanged(name: str, weight: np.ndarray) -> np.ndarray:
    return weight


def _gemma_norm_offset(name: str, weight: np.ndarray) -> np.ndarray:
    # llama.cpp stores Gemma's RMSNorm scale as (1 + w); mlx-lm's Gemma norms add the 1 themselves.
    return weight - 1.0 if name.endswith("norm.weight") else weight


def _rope_scaling(gguf_file: GGUFFile) -> dict[str, Any] | None:
    kind = gguf_file.arch_value("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(gguf_file.arch_value("rope.scaling.factor"))}
    raise UnsupportedModelError(
        f"{gguf_file.path.name}: rope scaling {kind!r} is not supported (supported: none, linear)"
    )


def _common_config(gguf_file: GGUFFile, vocab_size: int) -> dict[str, Any]:
    heads = gguf_file.arch_int("attention.head_count")
    hidden = gguf_file.arch_int("embedding_length")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": gguf_file.arch_int("block_count"),
        "intermediate_size": gguf_file.arch_int("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": gguf_file.arch_int("attention.head_count_kv", heads),
        "head_dim": gguf_file.arch_int("attention.key_length", hidden // heads),
        "rms_norm_eps": float(gguf_file.arch_value("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab_size,
        "max_position_embeddings": gguf_file.arch_int("context_length"),
        "rope_scaling": _rope_scaling(gguf_file),
    }


def _llama_config(gguf_file: GGUFFile, vocab_size: int) -> dict[str, Any]:
    config = _common_config(gguf_file, vocab_size)
    rope_dims = gguf_file.arch_int("rope.dimension_count", config["head_dim"])
    if rope_dims != config["head_dim"]:
        raise UnsupportedModelError(
            f"{gguf_file.path.name}: partial rotary embedding ({rope_dims} of "
            f"{config['head_dim']} dims) is not supported"
        )
    tensor_names = {t.name for t in gguf_file.tensors}
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **config,
        "rope_theta": float(gguf_file.arch_value("rope.freq_base", 10000.0)),
        # llama.cpp permutes Q and K rows into interleaved rotary pairs when it writes a llama
        # GGUF; the traditional (interleaved) RoPE on the unchanged rows computes the same scores.
        "rope_traditional": True,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
    }


def _gemma3_config(gguf_file: GGUFFile, vocab_size: int) -> dict[str, Any]:
    config = _common_config(gguf_file, vocab_size)
    # llama.cpp hard-codes these for gemma3 instead of storing them: local RoPE base 10k, one
    # global layer in every 6, and attention scaled by hidden/heads only for the 27B (62 layers).
    is_27b = config["num_hidden_layers"] == 62
    query_scale = config["hidden_size"] // config["num_attention_heads"] if is_27b else None
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        **config,
        "rope_theta": float(gguf_file.arch_value("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "sliding_window": gguf_file.arch_int("attention.sliding_window"),
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": query_scale or config["head_dim"],
    }


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    spec.gguf_name: spec
    for spec in (
        ArchitectureSpec(
            gguf_name="llama",
            model_type="llama",
            block_tensors=_LLAMA_BLOCK_TENSORS,
            build_config=_llama_config,
            fix_weight=_unchanged,
            allows_bias=True,
        ),
        ArchitectureSpec(
            gguf_name="gemma3",
            model_type="gemma3_text",
            block_tensors=_GEMMA3_BLOCK_TENSORS,
            build_config=_gemma3_config,
            fix_weight=_gemma_norm_offset,
            allows_bias=False,
        ),
    )
}


def architecture_spec(gguf_file: GGUFFile) -> ArchitectureSpec:
    name = gguf_file.architecture
    spec = ARCHITECTURES.get(name)
    if spec is None:
        raise UnsupportedModelError(
            f"{gguf_file.path.name}: GGUF architecture {name!r} is not supported; "
            f"supported architectures: {', '.join(sorted(ARCHITECTURES))}"
        )
    return spec


def check_tensors(gguf_file: GGUFFile, spec: ArchitectureSpec) -> None:
    """Fail before any work on a tensor with an unknown name or a type we cannot dequantize."""
    for tensor in gguf_file.tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise UnsupportedModelError(
                f"{gguf_file.path.name}: tensor {tensor.name!r} has type "
                f"{tensor.tensor_type.name}, which the importer does not support; "
                f"supported tensor types: {supported}"
            )
        if spec.mlx_name(tensor.name) is None:
            raise UnsupportedModelError(
                f"{gguf_file.path.name}: tensor {tensor.name!r} has no counterpart in mlx-lm's "
                f"{spec.model_type!r} model; this {spec.gguf_name} variant is not supported"
            )
