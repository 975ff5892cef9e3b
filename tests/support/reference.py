"""Reference outputs computed without the engine: plain mlx-lm, computed once per distinct question.

A reference is a pure function of the model's weights, the prompt, the
settings and the mlx / mlx-lm versions, and the slow part of many tests (a
4K-token prefill is ~50 s on a 2-core CPU). So each is kept: in memory for
the session, and on disk under ``$SEMANTIC_TEST_REFERENCE_CACHE`` (default
``~/.cache/semantic-test/references``; empty: memory only), keyed by a
digest of exactly those inputs. A fresh machine computes each distinct one
once; a developer's second run reads them back. Changing the weights, the
prompt, a setting or either library's version is another key.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

CACHE_VARIABLE = "SEMANTIC_TEST_REFERENCE_CACHE"
_digests: dict[int, tuple[Any, str]] = {}  # id(model) -> (model, digest): the model is kept, so its id is never reused
_memory: dict[str, Any] = {}


def model_digest(model: Any) -> str:
    """BLAKE2b of every parameter's name, shape, dtype and values (once per model object)."""
    known = _digests.get(id(model))
    if known is not None and known[0] is model:
        return known[1]
    digest = hashlib.blake2b(digest_size=16)
    for name, value in tree_flatten(model.parameters()):
        digest.update(f"{name}:{value.shape}:{value.dtype}".encode())
        data = value if value.dtype != mx.bfloat16 else value.view(mx.uint16)
        digest.update(np.asarray(data).tobytes())
    _digests[id(model)] = (model, digest.hexdigest())
    return _digests[id(model)][1]


def _directory() -> Path | None:
    configured = os.environ.get(CACHE_VARIABLE)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    return Path.home() / ".cache" / "semantic-test" / "references"


def _key(kind: str, model: Any, question: Any) -> tuple[str, Path | None]:
    key = hashlib.sha256(json.dumps([kind, model_digest(model), question, version("mlx"), version("mlx-lm")],
                                    sort_keys=True).encode()).hexdigest()
    directory = _directory()
    return key, directory / f"{kind}-{key[:32]}.json" if directory is not None else None


def known(kind: str, model: Any, question: Any) -> bool:
    key, path = _key(kind, model, question)
    return key in _memory or (path is not None and path.is_file())


def cached(kind: str, model: Any, question: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``'s JSON-able answer to ``question`` about ``model``, from memory or disk when asked before."""
    key, path = _key(kind, model, question)
    if key in _memory:
        return _memory[key]
    if path is not None and path.is_file():
        try:
            _memory[key] = json.loads(path.read_text())["answer"]
            return _memory[key]
        except (ValueError, KeyError, OSError):
            pass  # a damaged entry is computed again and replaced
    answer = _memory[key] = compute()
    if path is not None:
        _write(path, {"kind": kind, "question": question, "answer": answer})
    return answer


def _write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".partial", delete=False) as out:
        json.dump(record, out)
    os.replace(out.name, path)


# generate_step's ``prefill_step_size``: the engine's default chunk (Settings.prefill_step_size), not
# generate_step's own default of 2048. Still plain mlx-lm, and on this CPU much cheaper: MLX's attention
# over a 2048-query chunk scores every query against every key before the causal mask drops half, in
# arrays far past the caches; measured on SmolLM2, a 2,048-token prefill takes 25.8 s in one chunk and
# 17.1 s in 512-token chunks, a 4,096-token one 70.5 s against 52.4 s (Gemma 3, 2,048 tokens: 11.1 / 8.2 s).
PREFILL_STEP = 512


def reference_greedy(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """Single-stream mlx-lm greedy tokens, stopping after an EOS token like the engine does."""
    question = [list(map(int, prompt)), max_tokens, sorted(eos), PREFILL_STEP]
    return cached("greedy", model, question, lambda: _greedy(model, prompt, max_tokens, eos))


def _greedy(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    return _collect(generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=PREFILL_STEP),
                    max_tokens, eos)


def _collect(steps, max_tokens: int, eos: set[int]) -> list[int]:
    """A generate_step's tokens, through the first EOS token (kept, as the engine counts it)."""
    out: list[int] = []
    for (token, _), _ in zip(steps, range(max_tokens)):
        out.append(int(token))
        if out[-1] in eos:
            break
    steps.close()
    # generate_step leaves the next token in flight on mlx-lm's stream; an
    # unfinished stream task at interpreter exit aborts the process.
    mx.synchronize(generation_stream)
    return out


def reference_greedy_shared(model, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
    """``reference_greedy`` of each prompt, computing their common prefix once (and each answer kept as
    reference_greedy keeps it, so either function finds the other's)."""
    def question(prompt: list[int]) -> list[Any]:
        return [list(map(int, prompt)), max_tokens, sorted(eos), PREFILL_STEP]

    missing = [p for p in prompts if not known("greedy", model, question(p))]
    if missing:
        for prompt, tokens in zip(missing, _greedy_shared(model, missing, max_tokens, eos)):
            cached("greedy", model, question(prompt), lambda tokens=tokens: tokens)
    return [reference_greedy(model, p, max_tokens, eos) for p in prompts]


def _greedy_shared(model, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
    """Plain mlx-lm greedy decoding of each prompt, their common prefix prefilled once.

    Plain mlx-lm throughout: the prefix is prefilled in ``PREFILL_STEP`` chunks,
    as ``generate_step`` does, into a fresh cache, and each prompt continues from
    a copy of it (``a[:]`` makes new array objects over the same data: one
    prompt's writes never reach the next one's copy). On this CPU a 4K-token
    prefill takes about 50 s; eight of them would dominate a test.
    """
    common = len(prompts[0])
    for prompt in prompts[1:]:
        common = next((i for i, (a, b) in enumerate(zip(prompts[0], prompt)) if a != b), min(common, len(prompt)))
    common = min(common, min(len(p) for p in prompts) - 1)  # every prompt keeps a token to feed
    cache = make_prompt_cache(model)
    for i in range(0, common, PREFILL_STEP):
        model(mx.array([prompts[0][i:min(i + PREFILL_STEP, common)]]), cache=cache)
        mx.eval([c.state for c in cache])
    saved = [{k: (v[:] if isinstance(v, mx.array) else v) for k, v in c.__dict__.items()} for c in cache]
    results = []
    for prompt in prompts:
        copy = []
        for c, fields in zip(cache, saved):
            fresh = type(c).__new__(type(c))
            fresh.__dict__.update({k: (v[:] if isinstance(v, mx.array) else v) for k, v in fields.items()})
            copy.append(fresh)
        results.append(_collect(generate_step(mx.array(prompt[common:]), model, max_tokens=max_tokens,
                                              prompt_cache=copy, prefill_step_size=PREFILL_STEP), max_tokens, eos))
    return results


def reference_ruled(model, prompt: list[int], max_tokens: int, eos: set[int], fmt, budget: int | None,
                    decode) -> list[int]:
    """Plain mlx-lm greedy decoding with a reasoning budget's rule applied by a logits processor of its own: the
    tokens the engine must produce for a thinking model's turn with that budget (domain/reasoning_tracker.py
    decides the rule; this checks that the batch applies it at the right token, pipelined or speculating)."""
    question = [list(map(int, prompt)), max_tokens, sorted(eos), repr(fmt), budget, PREFILL_STEP]
    return cached("ruled", model, question, lambda: _ruled(model, prompt, max_tokens, eos, fmt, budget, decode))


def _ruled(model, prompt: list[int], max_tokens: int, eos: set[int], fmt, budget: int | None, decode) -> list[int]:
    from engine.domain.reasoning_tracker import start_tracker
    from engine.runtime.runner.token_masks import Only, Without, masked

    tracker = start_tracker(fmt, prompt, decode, budget)
    fed = 0

    def rule(history: mx.array, logits: mx.array) -> mx.array:
        nonlocal fed
        for token in history.tolist()[len(prompt) + fed:]:
            tracker.feed(token)
            fed += 1
        ruled = tracker.rule()
        if ruled is None:
            return logits
        mask = Only(ruled.force) if ruled.force is not None else Without(ruled.forbid)
        return masked(logits, [(0, mask)])

    return _collect(generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=PREFILL_STEP,
                                  logits_processors=[rule]), max_tokens, eos)
