"""Per-request samplers for the BatchGenerator.

Greedy requests share mlx-lm's ``greedy_sampler`` object so the batch samples
them in one call. A seeded request carries its own PRNG key, split once per
token, so its output depends only on its seed and not on what else shares
the batch.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p, greedy_sampler, make_sampler

from .requests import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def build_sampler(params: SamplingParams) -> Sampler:
    if params.is_greedy:
        return greedy_sampler
    if params.seed is None:
        return make_sampler(temp=params.temperature, top_p=_top_p(params), top_k=params.top_k)
    return _SeededSampler(params)


def _top_p(params: SamplingParams) -> float:
    # mlx-lm treats 0 as "off"; the APIs use 1.0 for "off".
    return 0.0 if params.top_p >= 1.0 else params.top_p


class _SeededSampler:
    def __init__(self, params: SamplingParams) -> None:
        self._params = params
        self._key = mx.random.key(params.seed or 0)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        if 0 < self._params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self._params.top_p)
        if self._params.top_k > 0:
            logprobs = apply_top_k(logprobs, self._params.top_k)
        return mx.random.categorical(logprobs * (1 / self._params.temperature), key=sub)
