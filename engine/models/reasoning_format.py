"""How a loaded model marks its reasoning, read from its tokenizer once at load.

mlx-lm's tokenizer wrapper already knows the think markers
(``has_thinking``, ``think_start_tokens``/``think_end_tokens``: ``<think>``,
``<longcat_think>``, ``<|think:start|>``, Gemma 4's ``<|channel>thought`` ...
``<channel|>``, the xtml form). It has nothing for gpt-oss's harmony
messages (mlx-lm #875), which are recognised here by their special tokens.
A tokenizer with neither (SmolLM2, Gemma 3) has no reasoning format: every
token it writes is answer text, as before.
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
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    if not all(t in vocab for t in HARMONY_TOKENS):
        return None
    ids = [vocab[t] for t in HARMONY_TOKENS]
    encode = tokenizer.encode
    return HarmonyFormat(*ids, assistant=tuple(encode("assistant", add_special_tokens=False)),
                         analysis=tuple(encode("analysis", add_special_tokens=False)))


def describe(fmt: ReasoningFormat | None) -> str:
    return "none" if fmt is None else fmt.name
