"""Sampling one token per decode row, batched across rows that share their parameters.

Greedy rows take the argmax. Sampled rows are grouped by (temperature,
top_p, top_k); each group is filtered in one pass and sampled with the
Gumbel-max trick (argmax of ``logprob / T + Gumbel noise``, which is what
``mx.random.categorical`` does). Every request keeps its own PRNG key, split
once per token, and only its own noise comes from it: a seeded request's
output depends on its seed, not on what else shares the batch.

Why not mlx-lm's samplers row by row: ``apply_top_p`` sorts the whole
vocabulary (49K entries on SmolLM2, 262K on Gemma 3) for every row and every
token, and requests without a temperature are sampled by default (with the
model's generation_config.json values or 0.7 / 0.95 / 40), so that sort was
most of a batch-16 decode step. With ``top_k`` set, the nucleus lies inside
the top k (both keep the most probable tokens first), so filtering sorts only
k values. The kept set and the distribution over it equal mlx-lm's
``top_p`` then ``top_k`` on normalized log-probabilities. The top-k pass over
the vocabulary is the compute backend's (``TopK``): on the CPU it runs in numpy.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Callable, Sequence

import mlx.core as mx

from engine.domain.requests import SamplingParams

SEED_MODULUS = 2**64  # mx.random.key takes an unsigned 64-bit seed

# (logits, k) -> each row's k largest log-probabilities (normalized over the vocabulary) and their ids.
TopK = Callable[[mx.array, int], "tuple[mx.array, mx.array]"]


def mlx_top_k(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The top-k pass in MLX (``backends/mlx.py``'s, for callers without a backend)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    return mx.take_along_axis(logprobs, ids, axis=-1), ids


class RowSampler:
    """One request's sampling parameters and PRNG key."""

    def __init__(self, params: SamplingParams) -> None:
        assert not params.is_greedy, "greedy rows need no sampler"
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._key = mx.random.key(seed % SEED_MODULUS)

    @property
    def group(self) -> tuple[float, float, int]:
        p = self.params
        return (p.temperature, p.top_p, p.top_k)

    def uniforms(self, n: int) -> list[float]:
        """``n`` uniform draws in [0, 1) from this request's next key (a speculative step's acceptance tests)."""
        self._key, sub = mx.random.split(self._key)
        return mx.random.uniform(shape=(n,), key=sub).tolist()

    def noise(self, n: int) -> mx.array:
        """Gumbel noise for ``n`` candidates, from this request's next key."""
        self._key, sub = mx.random.split(self._key)
        return mx.random.gumbel(shape=(1, n), key=sub)


def build_sampler(params: SamplingParams) -> RowSampler | None:
    """None for greedy requests."""
    return None if params.is_greedy else RowSampler(params)


def sample(logits: mx.array, samplers: Sequence[RowSampler | None], top_k: TopK = mlx_top_k) -> mx.array:
    """One token id per row of ``logits`` [rows, vocab]; ``top_k``: the backend's top-k pass."""
    if all(s is None for s in samplers):
        return mx.argmax(logits, axis=-1)
    groups: dict[tuple[float, float, int] | None, list[int]] = defaultdict(list)
    for row, sampler in enumerate(samplers):
        groups[None if sampler is None else sampler.group].append(row)
    if len(groups) == 1:
        (group,) = groups
        return _sample_group(logits, [samplers[i] for i in groups[group]], top_k)  # type: ignore[misc]
    order: list[int] = []
    parts: list[mx.array] = []
    for group, rows in groups.items():
        picked = logits[mx.array(rows)] if len(rows) < len(samplers) else logits
        parts.append(mx.argmax(picked, axis=-1) if group is None
                     else _sample_group(picked, [samplers[i] for i in rows], top_k))  # type: ignore[misc]
        order.extend(rows)
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return mx.concatenate(parts)[mx.array(inverse)]


def _sample_group(logits: mx.array, samplers: list[RowSampler], top_k: TopK) -> mx.array:
    """Rows with equal parameters: filter them together, sample each with its own key."""
    params = samplers[0].params
    candidates, ids = filtered(logits, params.top_p, params.top_k, top_k)
    noise = mx.concatenate([s.noise(candidates.shape[-1]) for s in samplers], axis=0)
    choice = mx.argmax(candidates * (1 / params.temperature) + noise, axis=-1)
    if ids is None:
        return choice
    return mx.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]


def filtered(logits: mx.array, top_p: float, top_k: int,
             top_k_pass: TopK = mlx_top_k) -> tuple[mx.array, mx.array | None]:
    """The candidates a row samples from: log-probabilities (dropped ones -inf) and their token ids (None: all,
    in order). With nothing to filter, the logits themselves: a row's normalizer shifts all its candidates
    alike, so the draw needs none."""
    if 0 < top_k < logits.shape[-1]:
        return _top_p(*top_k_pass(logits, top_k), top_p)
    if 0 < top_p < 1:
        return _top_p(logits - mx.logsumexp(logits, axis=-1, keepdims=True), None, top_p)
    return logits, None


def _top_p(logprobs: mx.array, ids: mx.array | None, top_p: float) -> tuple[mx.array, mx.array | None]:
    """Drop, past the most probable, the tokens after ``top_p`` of the mass (log-probabilities normalized
    over the whole vocabulary); ``ids`` says which tokens ``logprobs`` hold (None: all, in order)."""
    if not 0 < top_p < 1:
        return logprobs, ids
    order = mx.argsort(-logprobs, axis=-1)
    logprobs = mx.take_along_axis(logprobs, order, axis=-1)
    ids = order if ids is None else mx.take_along_axis(ids, order, axis=-1)
    probs = mx.exp(logprobs.astype(mx.float32))
    # A token is dropped once the tokens more probable than it already hold top_p of the mass
    # (the log-probabilities are normalized over the whole vocabulary, so the mass is 1).
    mass_above = mx.cumsum(probs, axis=-1) - probs
    return mx.where(mass_above >= top_p, -mx.inf, logprobs), ids
