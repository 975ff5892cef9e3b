"""Rebuild a Hugging Face fast tokenizer from the vocabulary stored in a GGUF file's metadata.

A GGUF carries no ``tokenizer.json``: llama.cpp keeps the tokens, merges, token types and special
ids as ``tokenizer.ggml.*`` keys. Two vocabulary kinds are rebuilt here:

- ``gpt2`` (byte-level BPE, e.g. SmolLM2): built directly with ``tokenizers``.
- ``llama`` (SentencePiece-style BPE, e.g. Gemma 3): built by transformers' GGUF tokenizer
  converter, which knows per-architecture quirks (Gemma's space tokens, merges recovered from the
  vocabulary order). That converter is an internal module, so it is called in one place, its
  failures become ``UnsupportedModelError``, and every rebuilt tokenizer must pass a round trip.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.errors import UnsupportedModelError
from engine.models.gguf_metadata import GGUFFile

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp pre-tokenizer names whose split rule is "each digit alone, then the GPT-2 regex".
_DIGIT_SPLITTING_PRE = frozenset({"smollm", "starcoder", "refact"})
# Names (or none at all) that mean the plain GPT-2 regex.
_GPT2_REGEX_PRE = frozenset({"gpt-2", "gpt2", "default"})

ROUND_TRIP_SAMPLES = (
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b  # sum\n\n\tindented\ttabs",
    "Numbers 3.14159 and 1234567, CAPS and  double  spaces.",
    "Grüße, naïve café, 日本語のテキスト, emoji 🤖🚀.",
)


@dataclass(frozen=True)
class TokenizerFiles:
    """A rebuilt tokenizer and the JSON files transformers' ``AutoTokenizer`` reads next to it."""

    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]
    special_tokens_map: dict[str, str]

    def write(self, folder: Path) -> list[str]:
        """Write the files into ``folder``; returns their names."""
        self.tokenizer.save(str(folder / "tokenizer.json"))
        _write_json(folder / "tokenizer_config.json", self.tokenizer_config)
        _write_json(folder / "special_tokens_map.json", self.special_tokens_map)
        return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def rebuild_tokenizer(gguf_file: GGUFFile) -> TokenizerFiles:
    """The tokenizer a GGUF file describes, verified by an encode/decode round trip."""
    kind = gguf_file.value("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(gguf_file)
    elif kind == "llama":
        tokenizer = _sentencepiece_via_transformers(gguf_file)
    else:
        raise UnsupportedModelError(
            f"{gguf_file.path.name}: tokenizer model {kind!r} is not supported; "
            "supported: gpt2, llama"
        )
    if gguf_file.value("tokenizer.ggml.add_bos_token", False):
        _prepend_bos(tokenizer, _special_token(gguf_file, "bos_token_id"))
    verify_round_trip(tokenizer, gguf_file.path.name)
    special_tokens = _special_tokens_map(gguf_file)
    return TokenizerFiles(tokenizer, _tokenizer_config(gguf_file, special_tokens), special_tokens)


def verify_round_trip(
    tokenizer: Tokenizer, label: str, samples: tuple[str, ...] = ROUND_TRIP_SAMPLES
) -> None:
    """Raise when decoding the encoding of a sample text does not give the text back."""
    for text in samples:
        ids = tokenizer.encode(text).ids
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        if decoded != text:
            raise UnsupportedModelError(
                f"{label}: the tokenizer rebuilt from GGUF metadata does not round-trip "
                f"{text!r} (decoded {decoded!r})"
            )


def _byte_level_bpe(gguf_file: GGUFFile) -> Tokenizer:
    tokens: list[str] = gguf_file.value("tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in gguf_file.value("tokenizer.ggml.merges")]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(gguf_file)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    _add_marked_tokens(tokenizer, tokens, gguf_file.value("tokenizer.ggml.token_type", []))
    return tokenizer


def _byte_level_pre_tokenizer(gguf_file: GGUFFile) -> pre_tokenizers.PreTokenizer:
    pre = gguf_file.value("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_REGEX_PRE:
        return byte_level
    supported = ", ".join(sorted(_DIGIT_SPLITTING_PRE | _GPT2_REGEX_PRE))
    raise UnsupportedModelError(
        f"{gguf_file.path.name}: byte-level pre-tokenizer {pre!r} is not supported; "
        f"supported: {supported}"
    )


def _add_marked_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    # Control tokens (<|im_start|>) must be matched whole and hidden by skip_special_tokens;
    # user-defined ones are matched whole but stay ordinary text.
    # A file without token types (token_types == []) marks nothing.
    marked = list(zip(tokens, token_types, strict=False))
    control = [t for t, kind in marked if kind == TOKEN_TYPE_CONTROL]
    user_defined = [t for t, kind in marked if kind == TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])


def _sentencepiece_via_transformers(gguf_file: GGUFFile) -> Tokenizer:
    # Internal transformers API (checked against transformers 5.x): a changed signature or a
    # missing architecture must surface as a clear import error, not as a broken tokenizer.
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        renames: dict[str, str] = GGUF_TOKENIZER_MAPPING["tokenizer"]
        tokenizer_dict = {
            name: gguf_file.value(f"tokenizer.{key}")
            for key, name in renames.items()
            if gguf_file.has(f"tokenizer.{key}")
        }
        tokenizer, _ = convert_gguf_tokenizer(gguf_file.architecture, tokenizer_dict)
    except Exception as exc:
        raise UnsupportedModelError(
            f"{gguf_file.path.name}: could not rebuild the SentencePiece-style tokenizer of "
            f"architecture {gguf_file.architecture!r} with transformers' GGUF converter: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return tokenizer


def _prepend_bos(tokenizer: Tokenizer, bos: str | None) -> None:
    if bos is None:
        return
    bos_id = tokenizer.token_to_id(bos)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
    )


def _special_token(gguf_file: GGUFFile, id_key: str) -> str | None:
    token_id = gguf_file.value(f"tokenizer.ggml.{id_key}", None)
    if token_id is None:
        return None
    return gguf_file.value("tokenizer.ggml.tokens")[int(token_id)]


def _special_tokens_map(gguf_file: GGUFFile) -> dict[str, str]:
    keys = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    found = {name: _special_token(gguf_file, key) for name, key in keys.items()}
    return {name: token for name, token in found.items() if token is not None}


def _tokenizer_config(gguf_file: GGUFFile, special_tokens: dict[str, str]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens,
        "add_bos_token": bool(gguf_file.value("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(gguf_file.value("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": gguf_file.arch_int("context_length"),
    }
    chat_template = gguf_file.value("tokenizer.chat_template", None)
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
