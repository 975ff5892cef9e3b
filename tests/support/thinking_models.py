"""Tiny random-weight thinking models: mlx-lm's own classes at the vocabulary of a MarkerTokenizer.

A reasoning model's markers are single tokens of its tokenizer (Qwen3's
``<think>``, harmony's ``<|channel|>``...); here they are the
MarkerTokenizer's specials past the bytes, so the model's embedding table
is that much wider. The configs are mlx-lm's own test configs
(bench/family_configs.json), as for every other family.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes

from engine.domain.reasoning import ReasoningFormat
from engine.models.cache_spec import derive_cache_spec
from engine.models.loaded import LoadedModel, ModelIdentity
from engine.models.materialize import evaluate_all_arrays

from .marker_tokenizer import HARMONY, THINK, MarkerTokenizer
from .tiny_models import recurrent_family_config, vary

# The families whose templates and markers issue 48 names: Qwen3 (dense) and Qwen3.5 (hybrid) with <think>,
# gpt-oss with harmony, Gemma 4 with its channel markers.
SPECIALS = {"qwen3": THINK, "qwen3_5": THINK, "gpt_oss": HARMONY, "gemma4_text": ("<|channel>", "<channel|>")}
STOPS = {"gpt_oss": ("<|call|>", "<|return|>")}


def thinking_tokenizer(kind: str) -> MarkerTokenizer:
    return MarkerTokenizer(SPECIALS[kind], stop=STOPS.get(kind, ()))


def tiny_thinking(kind: str, seed: int = 0):
    tokenizer = thinking_tokenizer(kind)
    config = recurrent_family_config(kind, tokenizer.vocab_size)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    vary(model, seed)
    evaluate_all_arrays(model)
    return model, tokenizer


def loaded_thinking(kind: str, block_tokens: int = 16, context: int = 2048, seed: int = 0,
                    reasoning: ReasoningFormat | None = None) -> LoadedModel:
    """``reasoning``: the format to use when the tokenizer's own facts do not give it (Gemma 4's start marker,
    ``<|channel>thought``, is several of these tokens)."""
    model, tokenizer = tiny_thinking(kind, seed)
    return LoadedModel(
        model_id=f"tiny-thinking-{kind}", identity=ModelIdentity(f"tiny-thinking-{kind}", f"seed{seed:04d}" * 4),
        path=Path("/nonexistent") / f"tiny-thinking-{kind}", architecture=kind, model=model, tokenizer=tokenizer,
        spec=derive_cache_spec(model, block_tokens), context_length=context, reasoning=reasoning)
