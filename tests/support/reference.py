"""Reference outputs computed without the engine."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream


def reference_greedy(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """Single-stream mlx-lm greedy tokens, stopping after an EOS token like the engine does."""
    out: list[int] = []
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
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
