"""A long prefill chunk's softmax in compiled rows (host_softmax, softmax_kernel), and where the CPU backend uses it."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.runtime.runner.backends.cpu import backend as cpu_backend, cpu_math, host_softmax
from engine.runtime.runner.backends.cpu.backend import CpuBackend
from engine.runtime.runner.backends.cpu.host_attention import HOST_ATTENTION, HOST_ATTENTION_IN_GRAPH
from engine.runtime.runner.backends.cpu.host_softmax import ROW_SOFTMAX
from engine.runtime.runner.backends.cpu.parallel_gate import PARALLEL
from engine.runtime.runner.backends.cpu.softmax_kernel import softmax_rows
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.attention_inputs import make_mask, qkv
from tests.support.byte_tokenizer import BOS
from tests.support.family_engine import accounts_agree, check, start
from tests.support.tiny_models import loaded_tiny
from tests.support.warm_ups import wait_for_warm_ups

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _kernel_loaded() -> None:
    wait_for_warm_ups()  # (a warm-up holds the parallel gate for a moment)
    ROW_SOFTMAX.warm_up()


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the scores the kernel turned into weights."""
    calls: list[tuple[int, ...]] = []
    real = ROW_SOFTMAX.in_place

    def counted(scores, visible=None):
        done = real(scores, visible)
        if done:
            calls.append(tuple(scores.shape))
        return done

    monkeypatch.setattr(ROW_SOFTMAX, "in_place", counted)
    return calls


def test_rows_equal_mlxs_precise_softmax() -> None:
    scores = mx.random.normal((64, 3000), key=mx.random.key(1)) * mx.array([0.1, 3.0, 30.0, 300.0] * 750)
    scores[5, 100:] = mx.finfo(mx.float32).min  # a masked row: its keys past 100 take no weight
    mx.eval(scores)
    rows = np.array(scores)
    softmax_rows(rows, np.full(64, 3000, np.int64))
    np.testing.assert_allclose(rows, np.array(mx.softmax(scores, axis=-1, precise=True)), rtol=2e-6, atol=1e-12)
    assert rows[5, 100:].max() == 0.0


def test_a_rows_visible_count_cuts_its_keys_without_reading_them() -> None:
    scores = np.array(mx.random.normal((4, 50), key=mx.random.key(2)) * 4)
    expected = [np.exp(r[:n] - r[:n].max()) / np.exp(r[:n] - r[:n].max()).sum() for r, n in zip(scores, (50, 1, 17, 30))]
    scores[2, 17:] = np.nan  # past the row's count: never read
    softmax_rows(scores, np.array([50, 1, 17, 30], np.int64))
    for row, n, want in zip(scores, (50, 1, 17, 30), expected):
        np.testing.assert_allclose(row[:n], want, rtol=2e-6)
        assert not row[n:].any()


def _qkv(batch: int, n: int, length: int, heads: int = 8, kv_heads: int = 2, dtype: mx.Dtype = mx.float32):
    return qkv(batch, n, length, heads, kv_heads, dim=32, dtype=dtype)


def _mask(kind: str, batch: int, n: int, length: int):
    return make_mask(kind, batch, n, length, heads=8)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "per-head bool", "per-row bool"])
@pytest.mark.parametrize("batch", [1, 2])
def test_attention_in_blocks_equals_mlxs_fused_attention(mask_kind: str, batch: int, monkeypatch,
                                                         kernel_calls) -> None:
    n, length = 40, 300
    monkeypatch.setattr(host_softmax, "BLOCK_SCORES", batch * 8 * 12 * length)  # blocks of 12 queries: 4 blocks
    q, k, v = _qkv(batch, n, length)
    mask = _mask(mask_kind, batch, n, length)
    ours = host_softmax.attention(q, k, v, 0.125, mask, cpu_math.softmax)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=2e-6)
    assert [shape[2] for shape in kernel_calls] == [4 * 12, 4 * 12, 4 * 12, 4 * 4]  # grouped heads x queries


def test_without_grouped_queries_and_in_bfloat16() -> None:
    q, k, v = _qkv(1, 24, 100, heads=4, kv_heads=4, dtype=mx.bfloat16)
    ours = host_softmax.attention(q, k, v, 0.2, "causal", cpu_math.softmax)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    assert ours.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)), atol=2e-2)


@pytest.mark.parametrize("mask_kind", ["causal", "bool"])
def test_a_block_that_finds_the_parallel_gate_taken_takes_mlxs_softmax(mask_kind: str, kernel_calls) -> None:
    q, k, v = _qkv(1, 30, 200)
    mask = _mask(mask_kind, 1, 30, 200)
    with PARALLEL:  # another thread inside a parallel loop (parallel_gate.py)
        declined = host_softmax.attention(q, k, v, 0.125, mask, cpu_math.softmax)
    assert kernel_calls == []
    taken = host_softmax.attention(q, k, v, 0.125, mask, cpu_math.softmax)
    assert kernel_calls
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    for ours in (declined, taken):
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=2e-6)


def test_the_caches_attention_takes_the_rows_only_for_long_prefill_chunks(monkeypatch, kernel_calls) -> None:
    monkeypatch.setattr(cpu_math, "MAX_SCORES", 8 * 10 * 64)
    for attention in (HOST_ATTENTION, HOST_ATTENTION_IN_GRAPH):
        kernel_calls.clear()
        attention.sdpa(*_qkv(1, 1, 5000), 0.125, None)  # one query (decode): never
        attention.sdpa(*_qkv(1, 9, 64), 0.125, "causal")  # under MAX_SCORES
        assert kernel_calls == []
        q, k, v = _qkv(1, 11, 64)
        ours = attention.sdpa(q, k, v, 0.125, "causal")
        assert len(kernel_calls) == 1
        np.testing.assert_allclose(np.array(ours), np.array(
            mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")), atol=2e-6)
    monkeypatch.setattr(ROW_SOFTMAX, "ready", False)  # not loaded (yet, or here at all): cpu_math's blocks
    kernel_calls.clear()
    HOST_ATTENTION.sdpa(q, k, v, 0.125, "causal")
    assert kernel_calls == []


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_long_softmax_over_joined_segment_scores_takes_the_rows(dtype: mx.Dtype, monkeypatch, kernel_calls) -> None:
    monkeypatch.setattr(cpu_math, "MAX_SCORES", 1000)
    scores = (mx.random.normal((1, 2, 4, 6, 300), key=mx.random.key(3)) * 5).astype(dtype)
    expected = mx.softmax(scores, axis=-1, precise=True)
    mx.eval(expected)  # (the scores are given away: the weights may be written into their buffer)
    weights = HOST_ATTENTION.softmax(scores)
    assert kernel_calls == [(1, 2, 4, 6, 300)] and weights.dtype == dtype
    np.testing.assert_allclose(np.array(weights.astype(mx.float32)), np.array(expected.astype(mx.float32)),
                               rtol=1e-2 if dtype == mx.bfloat16 else 2e-6, atol=1e-7)


def test_the_backend_loads_the_kernel_and_says_so() -> None:
    backend, model = CpuBackend(), loaded_tiny("llama").model
    backend.attach(model)
    try:
        wait_for_warm_ups()
        assert backend.describe()["host_paths"]["prefill_softmax"] is True
    finally:
        backend.detach(model)  # (its hooks on mlx-lm's modules go with it)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_engine_turns_through_the_rows_are_token_identical_to_mlx_lm(kind: str, monkeypatch, kernel_calls,
                                                                    tmp_path: Path) -> None:
    """An attention model and a hybrid through the engine, their prefill chunks' attention in the rows (the
    limits lowered so that the tiny models' chunks count as long): two turns of one agent, then a second agent
    from the first one's prefix (attention over a shared segment and its own keys), each equal to mlx-lm."""
    monkeypatch.setattr(cpu_math, "MAX_SCORES", 2000)
    monkeypatch.setattr(host_softmax, "BLOCK_SCORES", 20_000)
    monkeypatch.setattr(cpu_backend, "HOST_PREFILL_MAX_TOKENS", 0)  # (else a tiny Llama's passes run on the host)
    loaded = loaded_tiny(kind)
    engine = start(loaded, WarmStore(tmp_path / "agents", stored_model(loaded), 1 << 30, EventLog()))  # (keeps shared prefixes)
    try:
        system = (BOS, *b"You are one of several agents sharing this long opening about caches. " * 3)
        prompt = system + tuple(b"First agent asks.")
        first = run_turn(engine, GenerationRequest("a", prompt, 8, prefix_hint=len(system)))
        check(loaded, first)
        assert kernel_calls, "the first turn's prefill took the rows"
        calls = len(kernel_calls)
        second = run_turn(engine, GenerationRequest("a", prompt + tuple(first.tokens) + tuple(b" And then?"), 8))
        check(loaded, second)
        other = run_turn(engine, GenerationRequest("b", system + tuple(b"Second agent asks something else."), 8,
                                                   prefix_hint=len(system)))
        check(loaded, other)
        assert other.finish.usage.reuse_source.startswith("shared:"), other.finish.usage
        assert len(kernel_calls) > calls
        accounts_agree(engine)
    finally:
        engine.stop()
