"""A speculative step's attention on the host (backends/cpu/host_verify_attention.py): each sequence's tokens together."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from threadpoolctl import threadpool_info

from engine.runtime.runner.backends.cpu import host_decode, host_verify_attention
from engine.runtime.runner.backends.cpu.backend import CpuBackend
from engine.runtime.runner.kv.full_kv import FullKV
from tests.unit.test_host_forward import Row, assert_same_caches, llama_model, prefilled

pytestmark = pytest.mark.unit


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, width: int) -> np.ndarray:
    """float64 attention of ``width`` queries (width, heads, dim; scaled) over keys (kv_heads, n, dim), token ``j``
    seeing all but the last ``width - 1 - j`` keys."""
    kv_heads, n, _ = keys.shape
    repeats = q.shape[1] // kv_heads
    out = np.empty(q.shape[:2] + (values.shape[-1],))
    for j in range(width):
        seen = n - (width - 1 - j)
        for h in range(q.shape[1]):
            s = keys[h // repeats, :seen].astype(np.float64) @ q[j, h].astype(np.float64)
            e = np.exp(s - s.max())
            out[j, h] = (e / e.sum()) @ values[h // repeats, :seen]
    return out


@pytest.mark.parametrize("width", [1, 2, 5])
def test_a_group_over_a_shared_segment_and_its_own_arrays_writes_its_positions_and_attends_causally(width: int) -> None:
    rng = np.random.default_rng(width)
    kv_heads, heads, dim, shared, own_held, capacity = 2, 6, 16, 9, 4, 16
    segment = [mx.array(rng.standard_normal((1, kv_heads, shared, dim)).astype(np.float32)) for _ in range(2)]
    own = [mx.array(rng.standard_normal((1, kv_heads, capacity, dim)).astype(np.float32)) for _ in range(2)]
    mx.eval(segment, own)
    new_keys, new_values = (rng.standard_normal((width, kv_heads, dim)).astype(np.float32) for _ in range(2))
    q = (rng.standard_normal((width, heads, dim)) * 0.5).astype(np.float32)
    claimed = list(range(own_held, own_held + width))
    parts = [[(segment[0], segment[1], shared), (own[0], own[1], at + 1)] for at in claimed]

    out = host_verify_attention.attend_groups(q, parts, new_keys, new_values, claimed, [width])

    for array, new in ((own[0], new_keys), (own[1], new_values)):  # written where claimed, nothing else touched
        np.testing.assert_array_equal(np.asarray(array)[0, :, own_held:own_held + width], new.transpose(1, 0, 2))
    keys = np.concatenate([np.asarray(segment[0])[0], np.asarray(own[0])[0, :, :own_held + width]], axis=1)
    values = np.concatenate([np.asarray(segment[1])[0], np.asarray(own[1])[0, :, :own_held + width]], axis=1)
    np.testing.assert_allclose(out, reference(q, keys, values, width), rtol=2e-5, atol=2e-6)


def test_groups_split_across_threads_give_what_one_thread_gives() -> None:
    """Three sequences with enough keys to take two threads: the same outputs and cache writes as on one."""
    rng = np.random.default_rng(7)
    kv_heads, heads, dim, capacity, widths = 2, 4, 8, 1200, [3, 1, 4]
    held = [1000, 700, 1100]

    def sequences():
        rng_here = np.random.default_rng(11)
        arrays = [[mx.array(rng_here.standard_normal((1, kv_heads, capacity, dim)).astype(np.float32))
                   for _ in range(2)] for _ in widths]
        mx.eval(arrays)
        claimed = [at + j for at, w in zip(held, widths) for j in range(w)]
        parts = [[(k, v, at + 1)] for (k, v), w, first in zip(arrays, widths, held)
                 for at in range(first, first + w)]
        return arrays, claimed, parts

    rows = sum(widths)
    q = rng.standard_normal((rows, heads, dim)).astype(np.float32)
    new_keys, new_values = (rng.standard_normal((rows, kv_heads, dim)).astype(np.float32) for _ in range(2))
    outs, caches = [], []
    for workers in (None, ThreadPoolExecutor(max_workers=2)):
        arrays, claimed, parts = sequences()
        outs.append(host_verify_attention.attend_groups(q, parts, new_keys, new_values, claimed, widths, workers))
        caches.append([np.array(a) for pair in arrays for a in pair])
        if workers is not None:
            workers.shutdown()
    assert len(host_decode.thread_shares([w * (h + w) for w, h in zip(widths, held)], 2)) == 2
    np.testing.assert_array_equal(outs[0], outs[1])
    for one, two in zip(*caches):
        np.testing.assert_array_equal(one, two)


def test_positions_that_are_not_consecutive_are_refused() -> None:
    arrays = [mx.zeros((1, 1, 8, 4)) for _ in range(2)]
    mx.eval(arrays)
    parts = [[(arrays[0], arrays[1], 3)], [(arrays[0], arrays[1], 5)]]
    with pytest.raises(RuntimeError, match="not consecutive"):
        host_verify_attention.attend_groups(np.zeros((2, 1, 4), np.float32), parts, np.zeros((2, 1, 4), np.float32),
                                            np.zeros((2, 1, 4), np.float32), [2, 4], [2])


def test_blas_runs_on_one_thread_inside_and_gets_its_threads_back() -> None:
    before = {lib["filepath"]: lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}
    with host_verify_attention.one_blas_thread():
        inside = {lib["filepath"]: lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}
    after = {lib["filepath"]: lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}
    assert before and set(inside.values()) == {1}
    assert after == before


@pytest.mark.parametrize("widths", [[3], [4, 1, 6], [1, 1]], ids=["one-agent", "mixed", "no-drafts"])
def test_a_verification_on_the_host_gives_mlx_forward_logits_and_cache_writes(widths: list[int]) -> None:
    """Each agent's tokens through the CPU backend's verify (the host step with widths) against mlx-lm's
    forward over the same tokens, and the caches it wrote, for two steps (the second over the first's writes)."""
    model = llama_model(seed=3)
    backend = CpuBackend()
    backend.attach(model)
    prompts = [[(5 * b + 3 * i) % 97 for i in range(4 + 7 * b)] for b in range(len(widths))]
    host_rows = [Row(prefilled(model, p)) for p in prompts]
    mlx_rows = [prefilled(model, p, FullKV) for p in prompts]
    for step in range(2):
        inputs = [[(p[-1] + 11 * j + step) % 97 for j in range(w)] for p, w in zip(prompts, widths)]
        assert backend.steps_on_host(model, host_rows)
        logits, in_place = backend.verify(model, inputs, host_rows)
        assert in_place
        got = np.asarray(logits)
        expected = np.concatenate([np.asarray(model(mx.array([tokens]), cache=layers)[0])
                                   for tokens, layers in zip(inputs, mlx_rows)])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        assert (got.argmax(-1) == expected.argmax(-1)).all()
        assert_same_caches(host_rows, mlx_rows)
    backend.detach(model)
    backend.close()


def test_the_backends_warm_up_loads_the_verification_softmax_before_the_engine_is_ready() -> None:
    """A fresh process: the loops a verification or a riding prompt chunk uses are loaded during the warm-up the
    engine waits for, not on the first such step (a compile there stalled every agent for ~1 s after an
    install, ~0.3 s on each start)."""
    import subprocess
    import sys

    script = ("from engine.runtime.runner.backends.cpu import host_decode\n"
              "from engine.runtime.runner.backends.cpu.softmax_kernel import softmax_rows_here\n"
              "host_decode.warm_up()\n"
              "print(len(softmax_rows_here.signatures))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert int(out.stdout.split()[-1]) >= 1, out.stderr
