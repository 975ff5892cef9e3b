"""Reference outputs computed without the engine: plain mlx-lm, computed once per distinct question.

A reference is a pure function of the model's weights, the prompt, the
settings and the mlx / mlx-lm versions, and the slow part of many tests (a
4K-token prefill is ~50 s on a 2-core CPU). So each is kept: in memory for
the session, and on disk under ``$SEMANTIC_TEST_REFERENCE_CACHE`` (default
``~/.cache/semantic-test/references``; empty: memory only), keyed by a
digest of exactly those inputs. A fresh machine computes each distinct one
once; a developer's second run reads them back. Changing the weights, the
prompt, a setting or either library's version is another key.

Computing one is cheaper than a prefill from scratch where it can be with
no change in the answer: a prompt resumes from the deepest prefill chunk an
earlier prompt of the same model computed (the same chunks at the same
positions), and a greedy answer serves every smaller token cap.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
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


def cached(kind: str, model: Any, question: Any, compute: Callable[[], Any],
           answers: Callable[[Any], bool] = lambda known: True) -> Any:
    """``compute()``'s JSON-able answer to ``question`` about ``model``, from memory or disk when asked before
    and ``answers(that answer)`` says it still answers this call (else computed again and replaced)."""
    key, path = _key(kind, model, question)
    if key not in _memory and path is not None and path.is_file():
        try:
            _memory[key] = json.loads(path.read_text())["answer"]
        except (ValueError, KeyError, OSError):
            pass  # a damaged entry is computed again and replaced
    if key in _memory and answers(_memory[key]):
        STATS.read += 1
        return _memory[key]
    started = time.perf_counter()
    answer = _memory[key] = compute()
    STATS.computed += 1
    STATS.seconds += time.perf_counter() - started
    if path is not None:
        _write(path, {"kind": kind, "question": question, "answer": answer})
    return answer


@dataclass
class Stats:
    """What this session's references cost: printed at the end of a run (tests/conftest.py)."""
    computed: int = 0
    read: int = 0
    seconds: float = 0.0
    resumed_tokens: int = 0  # prompt tokens taken from an earlier prompt's prefilled chunks

    def line(self) -> str:
        return (f"references: {self.computed} computed in {self.seconds:.1f} s, {self.read} read back; "
                f"{self.resumed_tokens} prompt tokens resumed from shared chunks")


STATS = Stats()


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
    """Single-stream mlx-lm greedy tokens, stopping after an EOS token like the engine does.

    The cap is not part of the question: greedy tokens do not depend on it, so an answer computed with a
    larger cap (or one that ended on an EOS token before its cap) answers every smaller one, cut."""
    question = [list(map(int, prompt)), sorted(eos), PREFILL_STEP]

    def compute() -> dict[str, Any]:
        return {"tokens": _greedy(model, prompt, max_tokens, eos), "max_tokens": max_tokens}

    def answers(known: Any) -> bool:
        tokens = known["tokens"]
        ended = len(tokens) < known["max_tokens"] or bool(tokens and tokens[-1] in eos)
        return known["max_tokens"] >= max_tokens or ended

    return cached("greedy", model, question, compute, answers)["tokens"][:max_tokens]


def reference_greedy_shared(model, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
    """``reference_greedy`` of each prompt. Their common head is prefilled once, since every prompt's prefill
    starts from the deepest chunk boundary an earlier prompt of the same model already reached."""
    return [reference_greedy(model, p, max_tokens, eos) for p in prompts]


def _greedy(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """``generate_step`` over the prompt, the chunks an earlier prompt already prefilled taken from it."""
    cache, done = _prefilled(model, prompt)
    return _collect(generate_step(mx.array(prompt[done:]), model, max_tokens=max_tokens, prompt_cache=cache,
                                  prefill_step_size=PREFILL_STEP), max_tokens, eos)


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


# Prefilled chunks, shared by every reference of a session. generate_step prefills a prompt of n tokens in
# PREFILL_STEP-token chunks from position 0 and leaves its last token for the first step; so the cache after
# its k-th chunk depends only on the first k * PREFILL_STEP tokens, and a prompt that starts with them can
# resume from a copy of that cache and run exactly the computations a prefill from scratch would (the same
# chunks at the same positions: the answer is the same, bit for bit, whichever prompt came first). Held in
# memory only, least recently used dropped past the bound; prompts shorter than one chunk never enter.
SNAPSHOT_BYTES = 3 << 30
_snapshots: OrderedDict[str, tuple[list[Any], int]] = OrderedDict()
_snapshot_bytes = 0  # the bytes _snapshots holds


def _prefilled(model, prompt: list[int]) -> tuple[list[Any], int]:
    """A cache holding the prompt's whole chunks (as generate_step computes them) and how many tokens that is."""
    whole = (len(prompt) - 1) // PREFILL_STEP * PREFILL_STEP  # generate_step's chunks before its partial one
    done, cache = 0, None
    for end in range(whole, 0, -PREFILL_STEP):
        key = _snapshot_key(model, prompt[:end])
        saved = _snapshots.get(key)
        if saved is not None:
            _snapshots.move_to_end(key)
            done, cache = end, _copy(saved[0])
            STATS.resumed_tokens += end
            break
    cache = cache if cache is not None else make_prompt_cache(model)
    with mx.stream(generation_stream):
        for start in range(done, whole, PREFILL_STEP):
            model(mx.array(prompt[start:start + PREFILL_STEP])[None], cache=cache)
            mx.eval([c.state for c in cache])
            _keep(_snapshot_key(model, prompt[:start + PREFILL_STEP]), cache)
            mx.clear_cache()
    return cache, whole


def _snapshot_key(model, head: list[int]) -> str:
    return model_digest(model) + hashlib.sha256(np.asarray(head, dtype=np.int64).tobytes()).hexdigest()


def _keep(key: str, cache: list[Any]) -> None:
    global _snapshot_bytes
    saved = _copy(cache)
    size = sum(a.nbytes for c in saved for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
    _snapshots[key] = (saved, size)
    _snapshot_bytes += size
    while _snapshot_bytes > SNAPSHOT_BYTES and len(_snapshots) > 1:
        _snapshot_bytes -= _snapshots.popitem(last=False)[1][1]


def _copy(value: Any) -> Any:
    """A copy of a cache (any mlx-lm cache class, nested ones too) whose arrays are new objects: a cache writes
    into its arrays in place (``keys[..., a:b, :] = ...``), and that must never reach a kept snapshot."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and type(value).__module__.startswith("mlx_lm"):
        fresh = type(value).__new__(type(value))
        fresh.__dict__.update({k: _copy(v) for k, v in value.__dict__.items()})
        return fresh
    return value


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
