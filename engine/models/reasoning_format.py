"""How a loaded model marks its reasoning, read from its tokenizer once at load.

mlx-lm's tokenizer wrapper already knows the think markers
(``has_thinking``, ``think_start_tokens``/``think_end_tokens``: ``<think>``,
``<longcat_think>``, ``<|think:start|>``, Gemma 4's ``<|channel>thought`` ...
``<channel|>``, the xtml form). It has nothing for gpt-oss's harmony
messages (mlx-lm #875), which are recognised here by their special tokens.
A tokenizer with neither (SmolLM2, Gemma 3) has no reasoning format: every
token it writes is answer text.
"""

from __future__ import annotations

from typing import Any

from engine.domain.reasoning import HarmonyFormat, ReasoningFormat, ThinkFormat

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>")


def reasoning_format(tokenizer: Any) -> ReasoningFormat | None:
    harmony = _harmony(tokenizer)
    if harmony is not None:
        return harmony
    if not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tokenizer.think_start_tokens, tokenizer.think_end_tokens
    if not start or not end:
        return None
    return ThinkFormat(tuple(start), tuple(end), tokenizer.think_start, tokenizer.think_end)


def _harmony(tokenizer: Any) -> HarmonyFormat | None:
    ids = _token_ids(tokenizer, HARMONY_TOKENS)
    if ids is None:
        return None
    encode = tokenizer.encode
    return HarmonyFormat(*ids, assistant=tuple(encode("assistant", add_special_tokens=False)),
                         analysis=tuple(encode("analysis", add_special_tokens=False)))


def _token_ids(tokenizer: Any, tokens: tuple[str, ...]) -> list[int] | None:
    """Each token's id, or None when the vocabulary lacks one. Looked up one by one where the tokenizer can:
    building the whole vocabulary (``get_vocab``) takes 0.24 s for Gemma 3's 262K tokens, and every prompt
    renderer asks (measured: most of a fresh server's extra first-request time; bench_first_answer, the
    2-core CPU box)."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is not None:
        unknown = getattr(tokenizer, "unk_token_id", None)
        ids = [convert(token) for token in tokens]
        return None if any(i is None or i == unknown for i in ids) else [int(i) for i in ids]
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    return [vocab[t] for t in tokens] if all(t in vocab for t in tokens) else None


def describe(fmt: ReasoningFormat | None) -> str:
    return "none" if fmt is None else fmt.name
