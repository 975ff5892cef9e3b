"""Per-request samplers for the BatchGenerator.

Greedy requests share mlx-lm's ``greedy_sampler`` object so the batch samples
them in one call. Other requests carry their own PRNG key, split once per
token: a seeded request's output depends only on its seed, not on what else
shares the batch.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p, greedy_sampler

from .requests import SamplingParams

Sampler = Callable[[mx.array], mx.array]
SEED_MODULUS = 2**64  # mx.random.key takes an unsigned 64-bit seed


def build_sampler(params: SamplingParams) -> Sampler:
    if params.is_greedy:
        return greedy_sampler
    return _KeyedSampler(params)


class _KeyedSampler:
    def __init__(self, params: SamplingParams) -> None:
        self._params = params
        seed = params.seed if params.seed is not None else int.from_bytes(_entropy(), "little")
        self._key = mx.random.key(seed % SEED_MODULUS)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        if 0 < self._params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self._params.top_p)
        # A top_k at or above the vocabulary size filters nothing (and mlx-lm's
        # implementation rejects it), so it is skipped.
        if 0 < self._params.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self._params.top_k)
        return mx.random.categorical(logprobs * (1 / self._params.temperature), key=sub)


def _entropy() -> bytes:
    import os

    return os.urandom(8)
