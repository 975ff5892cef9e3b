"""The packaged GGUF models imported into MLX folders: they load in mlx-lm, answer sensibly, and
compute what a second, independent path computes.

- SmolLM2: logits are compared with a llama model built from MLX's own GGUF reader
  (``mx.load`` returns Q4_1/Q8_0 as quantized triples, dequantized here with ``mx.dequantize``),
  so the dequantization (gguf-py vs ggml C code), tensor names and config are all cross-checked.
- Gemma 3: MLX's reader cannot read K-quants, so layers 0 (sliding, local RoPE base) and 5
  (global, ``rope_theta``) and the tied output head are recomputed in numpy from the GGUF
  tensors as llama.cpp stores them (norm scales with the +1 included) and compared with mlx-lm.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import generate, load
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engine.models.gguf_import import MARKER_FILE
from engine.models.gguf_metadata import GGUFFile
from engine.models.gguf_tokenizer import ROUND_TRIP_SAMPLES

pytestmark = pytest.mark.model

CAPITAL_QUESTION = "What is the capital of France?"
GEMMA_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[nn.Module, object]:
    return load(str(smollm2_path))


@pytest.fixture(scope="module")
def gemma3(gemma3_path: Path) -> tuple[nn.Module, object]:
    return load(str(gemma3_path))


def chat_prompt(tokenizer: object, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


# -- SmolLM2 -----------------------------------------------------------------------------------


def test_smollm2_answers_the_capital_of_france(smollm2: tuple[nn.Module, object]) -> None:
    model, tokenizer = smollm2
    answer = generate(model, tokenizer, chat_prompt(tokenizer, CAPITAL_QUESTION), max_tokens=20)
    assert "Paris" in answer


def test_smollm2_tokenizer_round_trips_and_agrees_with_transformers(
    smollm2: tuple[nn.Module, object], smollm2_gguf_path: Path
) -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    _, tokenizer = smollm2
    gguf_file = GGUFFile(smollm2_gguf_path)
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    fields = {
        n: gguf_file.value(f"tokenizer.{k}")
        for k, n in renames.items()
        if gguf_file.has(f"tokenizer.{k}")
    }
    reference, _ = convert_gguf_tokenizer("llama", fields)
    for text in (*ROUND_TRIP_SAMPLES, "<|im_start|>user\nhi<|im_end|>"):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert ids == reference.encode(text).ids, text


def test_smollm2_logits_match_mlx_gguf_reader(
    smollm2: tuple[nn.Module, object], smollm2_gguf_path: Path
) -> None:
    model, tokenizer = smollm2
    reference = llama_from_mlx_gguf_reader(smollm2_gguf_path)
    ids = mx.array([chat_prompt(tokenizer, CAPITAL_QUESTION)])
    ours, theirs = model(ids), reference(ids)
    max_abs_diff = mx.max(mx.abs(ours - theirs)).item()
    assert max_abs_diff < 1e-3, f"max |logits difference| {max_abs_diff}"
    assert mx.array_equal(mx.argmax(ours, axis=-1), mx.argmax(theirs, axis=-1))


def test_smollm2_folder_runs_under_the_mlx_lm_cli(smollm2_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "mlx_lm.generate",
        "--model",
        str(smollm2_path),
        "--prompt",
        "hi",
        "--max-tokens",
        "3",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=os.environ.copy()
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_import_marker_names_the_packaged_source(
    smollm2_path: Path, smollm2_gguf_path: Path
) -> None:
    marker = json.loads((smollm2_path / MARKER_FILE).read_text())
    assert marker["source_path"] == str(smollm2_gguf_path.resolve())
    assert marker["gguf_architecture"] == "llama" and marker["dtype"] == "float32"


_LLAMA_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip


def llama_from_mlx_gguf_reader(gguf_path: Path) -> llama.Model:
    """SmolLM2 built only from ``mx.load``'s view of the GGUF file, nothing from the importer."""
    raw, meta = mx.load(str(gguf_path), return_metadata=True)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=int(meta["llama.embedding_length"].item()),
        num_hidden_layers=int(meta["llama.block_count"].item()),
        intermediate_size=int(meta["llama.feed_forward_length"].item()),
        num_attention_heads=int(meta["llama.attention.head_count"].item()),
        num_key_value_heads=int(meta["llama.attention.head_count_kv"].item()),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"].item()),
        vocab_size=int(meta["llama.vocab_size"].item()),
        rope_theta=float(meta["llama.rope.freq_base"].item()),
        rope_traditional=True,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    model.load_weights(list(dequantize_mlx_triples(raw).items()))
    return model


def dequantize_mlx_triples(raw: dict[str, mx.array]) -> dict[str, mx.array]:
    weights = {}
    for name, value in raw.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" in raw:
            scales, biases = raw[f"{stem}.scales"], raw[f"{stem}.biases"]
            # Each group of 32 values fills `bits` uint32 words: 72 words / 18 groups = 4 bits.
            bits = value.shape[1] // scales.shape[1]
            # float32 scales keep the float16 values exact and make the product float32.
            value = mx.dequantize(
                value,
                scales.astype(mx.float32),
                biases.astype(mx.float32),
                group_size=32,
                bits=bits,
            )
        weights[llama_parameter_name(name)] = value.astype(mx.float32)
    return weights


def llama_parameter_name(gguf_name: str) -> str:
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    layer, part = re.match(r"blk\.(\d+)\.(\w+)\.weight", gguf_name).groups()
    return f"model.layers.{layer}.{_LLAMA_PARTS[part]}.weight"


# -- Gemma 3 -----------------------------------------------------------------------------------


def test_gemma3_continues_a_sentence_about_france(gemma3: tuple[nn.Module, object]) -> None:
    model, tokenizer = gemma3
    continuation = generate(model, tokenizer, GEMMA_PROMPT, max_tokens=20)
    assert "France" in continuation or "Paris" in continuation, continuation


def test_gemma3_tokenizer_prepends_bos_and_round_trips(gemma3: tuple[nn.Module, object]) -> None:
    _, tokenizer = gemma3
    ids = tokenizer.encode(GEMMA_PROMPT)
    assert ids[0] == tokenizer.bos_token_id == 2
    for text in ROUND_TRIP_SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_gemma3_caches_follow_the_sliding_window_pattern(gemma3: tuple[nn.Module, object]) -> None:
    model, _ = gemma3
    caches = model.make_cache()
    assert len(caches) == 18
    assert [i for i, c in enumerate(caches) if type(c) is KVCache] == [5, 11, 17]
    assert all(c.max_size == 512 for c in caches if isinstance(c, RotatingKVCache))


def test_gemma3_layers_and_head_match_numpy_reference(
    gemma3: tuple[nn.Module, object], gemma3_gguf_path: Path
) -> None:
    model, tokenizer = gemma3
    reference = GemmaNumpyReference(GGUFFile(gemma3_gguf_path))
    ids = tokenizer.encode(GEMMA_PROMPT)
    hidden = reference.embed(ids)
    mask = create_attention_mask(mx.array(hidden[None]), None)
    for layer, rope_base in ((0, 10_000.0), (5, 1_000_000.0)):
        ours = np.array(model.model.layers[layer](mx.array(hidden[None]), mask, None)[0])
        assert relative_error(ours, reference.layer(layer, hidden, rope_base)) < 1e-5, (
            f"layer {layer}"
        )
    ours_logits = np.array(
        model.model.embed_tokens.as_linear(model.model.norm(mx.array(hidden[None])))[0]
    )
    assert relative_error(ours_logits, reference.logits(hidden)) < 1e-5


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


class GemmaNumpyReference:
    """Gemma 3 decoder pieces in numpy, written from the architecture, on GGUF-stored weights."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        self.tensors = {t.name: t for t in gguf_file.tensors}
        self.eps = float(gguf_file.arch_value("attention.layer_norm_rms_epsilon"))
        self.heads = gguf_file.arch_int("attention.head_count")
        self.head_dim = gguf_file.arch_int("attention.key_length")

    def weight(self, name: str) -> np.ndarray:
        tensor = self.tensors[name]
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)

    def embed(self, ids: list[int]) -> np.ndarray:
        # Scaled by sqrt(hidden) as Gemma does, so the layers see activations of realistic size.
        embedding = self.weight("token_embd.weight")
        return embedding[ids] * np.float32(np.sqrt(embedding.shape[1]))

    def rms_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        # llama.cpp stores Gemma's full norm scale (1 + w), so it multiplies in directly here.
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weight(name)

    def layer(self, index: int, x: np.ndarray, rope_base: float) -> np.ndarray:
        p = f"blk.{index}."
        h = x + self.rms_norm(
            self.attention(p, self.rms_norm(x, p + "attn_norm.weight"), rope_base),
            p + "post_attention_norm.weight",
        )
        return h + self.rms_norm(
            self.mlp(p, self.rms_norm(h, p + "ffn_norm.weight")), p + "post_ffw_norm.weight"
        )

    def attention(self, p: str, x: np.ndarray, rope_base: float) -> np.ndarray:
        tokens = x.shape[0]
        q = (x @ self.weight(p + "attn_q.weight").T).reshape(tokens, -1, self.head_dim)
        k = (x @ self.weight(p + "attn_k.weight").T).reshape(tokens, -1, self.head_dim)
        v = (x @ self.weight(p + "attn_v.weight").T).reshape(tokens, -1, self.head_dim)
        q = rope(self.rms_norm(q, p + "attn_q_norm.weight"), rope_base)
        k = rope(self.rms_norm(k, p + "attn_k_norm.weight"), rope_base)
        k, v = (np.repeat(t, self.heads // t.shape[1], axis=1) for t in (k, v))
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(self.head_dim)
        scores = np.where(np.tril(np.ones((tokens, tokens), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(tokens, -1)
        return out @ self.weight(p + "attn_output.weight").T

    def mlp(self, p: str, x: np.ndarray) -> np.ndarray:
        gate = x @ self.weight(p + "ffn_gate.weight").T
        gelu = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        return (gelu * (x @ self.weight(p + "ffn_up.weight").T)) @ self.weight(
            p + "ffn_down.weight"
        ).T

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.rms_norm(x, "output_norm.weight") @ self.weight("token_embd.weight").T


def rope(x: np.ndarray, base: float) -> np.ndarray:
    """Rotary embedding on (tokens, heads, dim), rotating the two halves (GPT-NeoX style)."""
    half = x.shape[-1] // 2
    angles = np.arange(x.shape[0])[:, None] * base ** (-np.arange(half) / half)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
