"""A draft model for speculative decoding: a small model with the served model's tokenizer.

``--speculate draft --draft-model REF`` (or just ``--draft-model REF``) loads
it next to the served model. It proposes each agent's next tokens greedily
and the served model verifies them in the batch's pass, as it verifies
looked-up drafts (runner/model_drafting.py). A wrong draft costs time,
never a token: what comes out is what the served model alone would produce.

Drafts are token ids, so the two models must number tokens alike: the load
is refused, naming both models and what differs, when their vocabularies or
their encodings of a probe text differ. The draft model's own cache is cut
back after every verification, so it must be a model whose every layer is
full attention (a plain ``KVCache``); sliding-window and recurrent drafts are
refused with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.models.loaded import DraftModel, LoadedModel

__all__ = ["DraftModel", "PROBE_TEXT", "load_draft_model", "check_draft_fits", "speculation_mode",
           "tokenizers_differ", "uncuttable_layers"]

# Text whose encoding two tokenizers must agree on (code, an accent, an emoji: the byte-fallback paths).
PROBE_TEXT = "def f(x):\n    return x + 1  # édition ünïcode 😀\n\tprint(f'{x!r}')"


def speculation_mode(speculate: str, loaded: LoadedModel) -> str:
    """How the batch speculates with ``loaded``, in words (/v1/stats): off, lookup, or the draft model's name."""
    if speculate == "draft":
        if loaded.draft is not None:
            return f"draft model {loaded.draft.model_id}"
        return "lookup (the draft model does not fit this model)"
    return speculate


def load_draft_model(ref: str, target: LoadedModel, cache_dir: Path, dtype: str = "auto",
                     trust_remote_code: bool = False) -> DraftModel:
    """Load ``ref`` and check that it can draft for ``target``; ModelLoadError with the reason otherwise."""
    from engine.models.loader import load_model

    loaded = load_model(ref, cache_dir, target.spec.block_tokens, dtype=dtype, trust_remote_code=trust_remote_code)
    check_draft_fits(loaded.model_id, loaded.model, loaded.tokenizer, target)
    return DraftModel(loaded.model_id, loaded.model, loaded)


def check_draft_fits(draft_id: str, model: Any, tokenizer: Any, target: LoadedModel) -> None:
    """Raise ModelLoadError when ``model`` cannot draft for ``target``: other token numbering, or a cache
    that cannot be cut back."""
    differs = tokenizers_differ(tokenizer, target.tokenizer)
    if differs:
        raise ModelLoadError(f"draft model {draft_id!r} cannot draft for {target.model_id!r}: {differs}; "
                             "a draft model must use the served model's tokenizer (--draft-model)")
    unfit = uncuttable_layers(model)
    if unfit:
        raise ModelLoadError(f"draft model {draft_id!r} cannot draft: its layers' caches ({unfit}) cannot be cut "
                             "back after a rejected draft; pick a full-attention model (--draft-model)")


def tokenizers_differ(a: Any, b: Any) -> str:
    """Why two tokenizers number tokens differently ('' when they agree on the vocabulary and a probe text)."""
    vocab_a, vocab_b = _vocabulary(a), _vocabulary(b)
    if vocab_a is not None and vocab_b is not None and vocab_a != vocab_b:
        only = len(set(vocab_a.items()) ^ set(vocab_b.items()))
        return f"their vocabularies differ ({len(vocab_a)} and {len(vocab_b)} tokens, {only} entries not shared)"
    if list(a.encode(PROBE_TEXT)) != list(b.encode(PROBE_TEXT)):
        return "they encode the same text as different tokens"
    return ""


def uncuttable_layers(model: Any) -> str:
    """The cache kinds of ``model``'s layers other than a plain KVCache, named ('' when all are plain)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
    return ", ".join(kinds)


def _vocabulary(tokenizer: Any) -> dict[str, int] | None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        return dict(get_vocab())
    except (AttributeError, NotImplementedError, TypeError):  # (transformers' base class raises NotImplemented)
        return None  # then the probe text alone decides
