"""A decode batch's attention in compiled loops (backends/cpu/host_decode.py): MLX's result, its conditions, its threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

from engine.runtime.runner.backends.cpu import host_decode
from engine.runtime.runner.backends.cpu.backend import CpuBackend, CpuOptions
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turns
from tests.support.byte_tokenizer import BOS
from tests.unit.test_engine_batching import make_engine

pytestmark = pytest.mark.unit

HEADS, KV_HEADS, DIM = 9, 3, 64
SCALE = DIM ** -0.5


def cache(length: int, capacity: int, seed: int) -> tuple[mx.array, mx.array, int]:
    """A row's own K/V as the engine passes them: arrays of a bigger capacity, and how many positions are its."""
    rng = np.random.default_rng(seed)
    keys, values = (mx.array(rng.standard_normal((1, KV_HEADS, capacity, DIM)).astype(np.float32)) for _ in range(2))
    return keys, values, length


def rows(lengths: list[int], prefix: int = 0) -> list[list[tuple[mx.array, mx.array, int]]]:
    shared = [cache(prefix, prefix, seed=99)] if prefix else []
    return [[*shared, cache(n, n + 37, seed=b)] for b, n in enumerate(lengths)]


def viewed(part: tuple[mx.array, mx.array, int]) -> tuple[mx.array, mx.array]:
    keys, values, length = part
    return keys[..., :length, :], values[..., :length, :]


def queries(batch: int) -> mx.array:
    return mx.array(np.random.default_rng(7).standard_normal((batch, HEADS, 1, DIM)).astype(np.float32))


def mlx_reference(q: mx.array, parts_per_row, masks) -> mx.array:
    outs = []
    for b, parts in enumerate(parts_per_row):
        keys = mx.concatenate([viewed(p)[0] for p in parts], axis=2)
        values = mx.concatenate([viewed(p)[1] for p in parts], axis=2)
        mask = masks[b] if isinstance(masks[b], mx.array) else None
        outs.append(mx.fast.scaled_dot_product_attention(q[b:b + 1], keys, values, scale=SCALE, mask=mask))
    return mx.concatenate(outs, axis=0)


@pytest.mark.parametrize("prefix", [0, 48])
def test_rows_of_different_lengths_and_shared_segments_equal_mlx_attention(prefix: int) -> None:
    parts = rows([5, 200, 64, 1], prefix)
    q = queries(4)
    masks = [None, "causal", None, None]
    got = host_decode.attend(q, parts, SCALE, masks)
    assert got.shape == (4, HEADS, 1, DIM) and got.dtype == mx.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(mlx_reference(q, parts, masks)), rtol=2e-5, atol=2e-6)


def test_a_segment_that_is_a_strided_view_is_read_as_its_positions() -> None:
    """Segments are whole arrays in the engine; a view of a bigger array (here every other position) is copied."""
    wide_k, wide_v, _ = cache(80, 80, seed=5)
    segment = (wide_k[..., ::2, :], wide_v[..., ::2, :], 40)
    parts = [[segment, cache(n, n + 3, seed=b)] for b, n in enumerate([7, 19])]
    q = queries(2)
    got = host_decode.attend(q, parts, SCALE, [None, None])
    np.testing.assert_allclose(np.asarray(got), np.asarray(mlx_reference(q, parts, [None, None])), rtol=2e-5, atol=2e-6)


def test_a_boolean_mask_per_key_hides_those_keys() -> None:
    parts = rows([30, 40])
    hidden = np.zeros(40, dtype=bool)
    hidden[:25] = True  # a window layer's ring: the oldest positions fell out of the window
    masks = [None, mx.array(~hidden)]
    q = queries(2)
    got = np.asarray(host_decode.attend(q, parts, SCALE, masks))
    np.testing.assert_allclose(got, np.asarray(mlx_reference(q, parts, masks)), rtol=2e-5, atol=2e-6)
    keys, values = viewed(parts[1][0])
    visible_only = [parts[0], [(keys[..., 25:, :], values[..., 25:, :], 15)]]
    np.testing.assert_allclose(got[1], np.asarray(mlx_reference(q, visible_only, [None, None]))[1], rtol=2e-5, atol=2e-6)


def test_rows_split_across_threads_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = rows([300, 20, 500, 80, 260, 9])
    q = queries(6)
    masks = [None] * 6
    monkeypatch.setattr(host_decode, "PARALLEL_MIN_KEYS", 10**9)
    alone = np.asarray(host_decode.attend(q, parts, SCALE, masks))
    monkeypatch.setattr(host_decode, "PARALLEL_MIN_KEYS", 0)
    monkeypatch.setattr(host_decode, "worker_count", lambda: 3)
    assert len(host_decode.thread_shares([300, 20, 500, 80, 260, 9], 3)) == 3
    with ThreadPoolExecutor(2) as workers:
        split = np.asarray(host_decode.attend(q, parts, SCALE, masks, workers=workers))
    assert np.array_equal(alone, split)


def test_chunks_cover_every_row_once_in_order_with_about_equal_keys() -> None:
    keys = [1100] * 4 + [10] * 8
    chunks = host_decode.thread_shares(keys, 2)
    assert [b for chunk in chunks for b in chunk] == list(range(12))
    assert len(chunks) == 2 and sum(keys[b] for b in chunks[0]) == 2200
    assert host_decode.thread_shares([100] * 16, 2) == [list(range(16))]  # 1,600 keys: under PARALLEL_MIN_KEYS, one thread
    assert host_decode.thread_shares(keys, 1) == [list(range(12))]


def test_it_applies_only_where_it_computes_what_mlx_would() -> None:
    parts = rows([10, 12])
    q = queries(2)
    assert host_decode.applies(q, parts, [None, "causal"], None)
    assert host_decode.applies(q, parts, [None, mx.ones((12,), dtype=mx.bool_)], None)
    assert not host_decode.applies(q, parts, [None, mx.zeros((12,))], None)  # additive masks: MLX's path
    assert not host_decode.applies(q, parts, [None, mx.ones((11,), dtype=mx.bool_)], None)
    assert not host_decode.applies(q, parts, [None, None], mx.zeros((HEADS,)))  # attention sinks
    assert not host_decode.applies(q[:1], parts[:1], [None], None)  # one row: the model's own attention
    assert not host_decode.applies(mx.concatenate([q, q], axis=2), parts, [None, None], None)  # prefill
    half = [[(k.astype(mx.float16), v.astype(mx.float16), n) for k, v, n in row] for row in parts]
    assert not host_decode.applies(q.astype(mx.float16), half, [None, None], None)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_a_batched_engine_decodes_through_it_with_the_tokens_mlx_attention_gives(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Gemma's window layers pass their rings (past the window: a boolean mask per key). The tiny
    Llama's decode steps would run on the host whole (host_forward.py, tested there): here they go through
    MLX's forward, whose attention hook hands its batch to host_decode."""
    calls = []
    real = host_decode.attend
    # (each call records whether the step's positions came to it to write in place: HostFullKV.claim_one)
    monkeypatch.setattr(host_decode, "attend", lambda *a: calls.append(a[4] is not None) or real(*a))
    prompts = [(BOS, *(f"agent {i} writes a longer line. " * (2 + i)).encode()) for i in range(4)]

    def decode(options: CpuOptions) -> list[list[int]]:
        engine = make_engine(kind, backend=CpuBackend(options))
        try:
            return [r.tokens for r in run_turns(engine, [GenerationRequest(f"a{i}", p, 40)
                                                         for i, p in enumerate(prompts)])]
        finally:
            engine.stop()

    with_numpy = decode(CpuOptions(host_step=False))
    assert calls, "the batch never reached host_decode"
    assert any(calls), "no decode position was written in place"
    calls.clear()
    assert decode(CpuOptions(host_step=False, decode_loops=False)) == with_numpy and not calls


def test_the_backend_loads_the_kernels_and_a_failure_leaves_attention_in_mlx(monkeypatch: pytest.MonkeyPatch,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    backend = CpuBackend()
    backend._load(host_decode.warm_up, "_loops_ok", "decode attention")
    assert backend.loops_ready()
    from engine.runtime.runner.backends.cpu import host_kernels

    def broken(*args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(host_kernels, "batch_rows", broken)
    with caplog.at_level("WARNING", logger="semantic.engine"):
        backend._load(host_decode.warm_up, "_loops_ok", "decode attention")
    assert not backend.loops_ready()
    assert "decode attention: MLX runs it instead" in caplog.text and "no compiler here" in caplog.text
    backend.close()


def test_a_failure_in_one_thread_waits_for_the_others_before_the_buffers_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """The threads read caches by address: attend may not return (or raise) while any of them still runs."""
    import threading
    import time

    from engine.runtime.runner.backends.cpu import host_kernels

    finished = []
    main = threading.get_ident()

    def rows_or_fail(*args):
        if threading.get_ident() == main:
            raise RuntimeError("this thread's rows failed")
        time.sleep(0.2)
        finished.append(args[6])  # the chunk's first row

    monkeypatch.setattr(host_decode, "PARALLEL_MIN_KEYS", 0)
    monkeypatch.setattr(host_decode, "worker_count", lambda: 2)
    monkeypatch.setattr(host_kernels, "batch_rows", rows_or_fail)
    with ThreadPoolExecutor(1) as workers, pytest.raises(RuntimeError, match="this thread's rows failed"):
        host_decode.attend(queries(4), rows([50, 50, 50, 50]), SCALE, [None] * 4, workers=workers)
    assert finished == [2]  # the other thread's chunk (rows 2-3) had finished
