"""The batched sampler keeps mlx-lm's top_p/top_k semantics, the right distribution, and per-request seeds."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from engine.domain.requests import SamplingParams
from engine.runtime.runner.backends.cpu.host_top_k import HostTopK
from engine.runtime.runner.sampling import RowSampler, build_sampler, filtered, mlx_top_k, sample

pytestmark = pytest.mark.unit


@pytest.fixture(params=["mlx", "host"])
def top_k(request: pytest.FixtureRequest):
    """Top-k rows are filtered in MLX, or by the CPU backend's pass in numpy (backends/cpu/host_top_k.py)."""
    return mlx_top_k if request.param == "mlx" else HostTopK()


def kept_by_mlx_lm(logprobs: mx.array, top_p: float, top_k: int) -> set[int]:
    """What mlx-lm's filters leave of one row (the order our previous sampler applied them in)."""
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, top_k)
    return {int(i) for i in np.nonzero(np.isfinite(np.array(logprobs[0])))[0]}


def kept_by_ours(logprobs: mx.array, top_p: float, top_k: int) -> set[int]:
    values, ids = filtered(logprobs, top_p, top_k)
    values = np.array(values[0])
    ids_np = np.arange(values.shape[-1]) if ids is None else np.array(ids[0])
    return {int(ids_np[j]) for j in np.nonzero(np.isfinite(values))[0]}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    top_p=st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.1]),
    top_k=st.sampled_from([0, 1, 5, 40]),
    sharpness=st.sampled_from([0.5, 2.0, 6.0]),
)
def test_the_kept_tokens_equal_mlx_lm_top_p_and_top_k(seed: int, top_p: float, top_k: int, sharpness: float) -> None:
    rng = np.random.default_rng(seed)
    logits = mx.array(rng.normal(size=(1, 300)).astype(np.float32) * sharpness)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert kept_by_ours(logprobs, top_p, top_k) == kept_by_mlx_lm(logprobs, top_p, top_k)
    if top_k:
        values, ids = filtered(logits, top_p, top_k, HostTopK())  # (from the raw logits: it normalizes them)
        kept = {int(np.array(ids[0])[j]) for j in np.nonzero(np.isfinite(np.array(values[0])))[0]}
        assert kept == kept_by_mlx_lm(logprobs, top_p, top_k)
        finite = np.isfinite(np.array(values[0]))
        np.testing.assert_allclose(np.array(values[0])[finite],
                                   np.array(logprobs[0])[np.array(ids[0])[finite]], rtol=1e-5, atol=1e-5)


def test_draws_follow_the_filtered_distribution(top_k) -> None:
    """Temperature scales the kept log-probabilities; dropped tokens are never drawn."""
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = mx.array(np.log(probs)[None, :].astype(np.float32))
    rows = 4000
    samplers = [RowSampler(SamplingParams(temperature=0.5, top_p=0.8, top_k=4, seed=i)) for i in range(rows)]
    tokens = np.array(sample(mx.repeat(logits, rows, axis=0), samplers, top_k))
    # top_p 0.8 keeps 0.4, 0.3, 0.15 (the mass above 0.15 is 0.7 < 0.8; above 0.1 it is 0.85).
    kept = probs[:3] ** 2  # temperature 0.5 squares the probabilities
    expected = kept / kept.sum()
    counts = np.bincount(tokens, minlength=5)
    assert counts[3] == counts[4] == 0
    assert np.allclose(counts[:3] / rows, expected, atol=0.03), (counts, expected)


def test_a_seeded_request_draws_the_same_tokens_alone_or_in_any_batch(top_k) -> None:
    row = mx.array(np.random.default_rng(0).normal(size=(1, 500)).astype(np.float32))
    mine = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=1234)
    same_group = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=5)
    other_group = SamplingParams(temperature=1.0, seed=7)

    def draws(batch: list[SamplingParams | None], position: int, steps: int = 8) -> list[int]:
        samplers = [build_sampler(p) if p is not None else None for p in batch]
        logits = mx.repeat(row, len(batch), axis=0)
        return [int(sample(logits, samplers, top_k)[position]) for _ in range(steps)]

    alone = draws([mine], 0)
    assert len(set(alone)) > 1  # it does sample
    assert draws([other_group, mine, None], 1) == alone
    assert draws([same_group, mine], 1) == alone
    assert draws([mine, same_group, other_group, None], 0) == alone


def test_greedy_rows_take_the_argmax_next_to_sampled_rows() -> None:
    logits = mx.array(np.random.default_rng(1).normal(size=(4, 100)).astype(np.float32))
    samplers = [None, build_sampler(SamplingParams(temperature=1.0, seed=3)), None,
                build_sampler(SamplingParams(temperature=0.3, top_k=5, seed=4))]
    tokens = np.array(sample(logits, samplers))
    best = np.argmax(np.array(logits), axis=-1)
    assert tokens[0] == best[0] and tokens[2] == best[2]
    assert tokens[3] in set(np.argsort(-np.array(logits[3]))[:5])


def test_temperature_alone_draws_from_the_whole_softened_distribution() -> None:
    """Nothing to filter: the draw skips the normalizer, and every token keeps its chance."""
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = mx.array(np.log(probs)[None, :].astype(np.float32) + 7.0)  # (unnormalized on purpose)
    rows = 4000
    samplers = [RowSampler(SamplingParams(temperature=2.0, seed=i)) for i in range(rows)]
    counts = np.bincount(np.array(sample(mx.repeat(logits, rows, axis=0), samplers)), minlength=5)
    expected = probs ** 0.5 / (probs ** 0.5).sum()  # temperature 2 takes the square root
    assert np.allclose(counts / rows, expected, atol=0.03), (counts, expected)
