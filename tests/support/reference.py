"""Reference outputs computed without the engine."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

# generate_step's ``prefill_step_size``: the engine's default chunk (Settings.prefill_step_size), not
# generate_step's own default of 2048. Still plain mlx-lm, and on this CPU much cheaper: MLX's attention
# over a 2048-query chunk scores every query against every key before the causal mask drops half, in
# arrays far past the caches; measured on SmolLM2, a 2,048-token prefill takes 25.8 s in one chunk and
# 17.1 s in 512-token chunks, a 4,096-token one 70.5 s against 52.4 s (Gemma 3, 2,048 tokens: 11.1 / 8.2 s).
PREFILL_STEP = 512


def reference_greedy(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """Single-stream mlx-lm greedy tokens, stopping after an EOS token like the engine does."""
    out: list[int] = []
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=PREFILL_STEP)
    for (token, _), _ in zip(steps, range(max_tokens)):
        token = int(token)
        out.append(token)
        if token in eos:
            break
    steps.close()
    # generate_step leaves the next token in flight on mlx-lm's stream; an
    # unfinished stream task at interpreter exit aborts the process.
    mx.synchronize(generation_stream)
    return out


def reference_greedy_shared(model, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
    """``reference_greedy`` of each prompt, computing their common prefix once.

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
        out: list[int] = []
        steps = generate_step(mx.array(prompt[common:]), model, max_tokens=max_tokens, prompt_cache=copy,
                              prefill_step_size=PREFILL_STEP)
        for (token, _), _ in zip(steps, range(max_tokens)):
            out.append(int(token))
            if out[-1] in eos:
                break
        steps.close()
        mx.synchronize(generation_stream)
        results.append(out)
    return results


def reference_ruled(model, prompt: list[int], max_tokens: int, eos: set[int], fmt, budget: int | None,
                    decode) -> list[int]:
    """Plain mlx-lm greedy decoding with a reasoning budget's rule applied by a logits processor of its own: the
    tokens the engine must produce for a thinking model's turn with that budget (domain/reasoning_tracker.py
    decides the rule; this checks that the batch applies it at the right token, pipelined or speculating)."""
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

    out: list[int] = []
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=PREFILL_STEP,
                          logits_processors=[rule])
    for (token, _), _ in zip(steps, range(max_tokens)):
        out.append(int(token))
        if out[-1] in eos:
            break
    steps.close()
    mx.synchronize(generation_stream)
    return out
