"""Tiny random-weight mlx-lm models built in-process (no files, no hub)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama

from engine.models.cache_spec import derive_cache_spec
from engine.models.loaded import LoadedModel, ModelIdentity

from .byte_tokenizer import VOCAB_SIZE, ByteTokenizer


def tiny_llama(seed: int = 0, layers: int = 2, head_dim: int | None = None):
    """Heads of 16 dims; ``head_dim`` widens them (64: wide enough for mx.quantize's groups)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB_SIZE,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_gemma3(seed: int = 0, window: int = 24):
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB_SIZE,
        sliding_window=window,
        sliding_window_pattern=3,
        max_position_embeddings=4096,
    )
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


def loaded_tiny(kind: str = "llama", block_tokens: int = 16, context: int = 2048, seed: int = 0) -> LoadedModel:
    # "llama-hd64": the tiny llama with 64-dim heads, for K/V quantized at rest (groups of 32 or more).
    model = {"llama": lambda: tiny_llama(seed), "llama-hd64": lambda: tiny_llama(seed, head_dim=64),
             "gemma": lambda: tiny_gemma3(seed)}[kind]()
    spec = derive_cache_spec(model, block_tokens)
    return LoadedModel(
        model_id=f"tiny-{kind}",
        identity=ModelIdentity(f"tiny-{kind}", f"seed{seed:04d}" * 4),
        path=Path("/nonexistent") / f"tiny-{kind}",
        architecture=kind,
        model=model,
        tokenizer=ByteTokenizer(),
        spec=spec,
        context_length=context,
    )
