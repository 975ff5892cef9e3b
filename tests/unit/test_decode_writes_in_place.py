"""A decode step's key and value written in place by host_decode, where no view can show the position.

The MLX way is two slice updates per row and layer (~2,000 small operations
a step at 16 rows x 30 layers); host_decode's loops instead copy the new
position into the row's own arrays before the row attends. That is a write
behind MLX's back, so it is allowed only into positions never written in
those arrays (``HostFullKV.claim_one``, the CPU backend's caches): a view taken earlier, a rewound cache,
or arrays set from outside still go through MLX's copy-on-write.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.runtime.runner.backends.cpu import host_decode
from engine.runtime.runner.backends.cpu.backend import CpuBackend, CpuOptions
from engine.runtime.runner.backends.cpu.host_kv import HostFullKV
from engine.runtime.runner.kv.full_kv import KVShape
from engine.runtime.runner.kv.ragged import RaggedLayerCache

pytestmark = pytest.mark.unit

KV_HEADS, HEADS, DIM = 3, 9, 64
SCALE = DIM ** -0.5
SHAPE = KVShape(KV_HEADS, DIM, DIM, mx.float32)


def kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((1, KV_HEADS, n, DIM)).astype(np.float32)) for _ in range(2))


def filled(n: int, seed: int) -> HostFullKV:
    layer = HostFullKV(SHAPE, block_tokens=16)
    layer.reserve(n + 4)
    layer.update_and_fetch(*kv(n, seed))
    mx.eval(layer.keys, layer.values)
    return layer


@pytest.fixture
def backend():
    backend = CpuBackend()
    yield backend
    backend.close()


def decode_step(backend: CpuBackend, rows: list[HostFullKV], seed: int) -> tuple[mx.array, mx.array, mx.array, RaggedLayerCache]:
    """One layer of a decode step through the backend's layer view, as the model makes it."""
    rng = np.random.default_rng(seed)
    new_k, new_v = (mx.array(rng.standard_normal((len(rows), KV_HEADS, 1, DIM)).astype(np.float32)) for _ in range(2))
    queries = mx.array(rng.standard_normal((len(rows), HEADS, 1, DIM)).astype(np.float32))
    layer = backend.ragged(rows)
    layer.update_and_fetch(new_k, new_v)
    return layer.attend(queries, SCALE, None), new_k, new_v, queries


def reference(queries: mx.array, rows_kv: list[tuple[mx.array, mx.array]]) -> np.ndarray:
    return np.concatenate([np.asarray(mx.fast.scaled_dot_product_attention(queries[b:b + 1], k, v, scale=SCALE))
                           for b, (k, v) in enumerate(rows_kv)])


def test_claim_one_takes_only_positions_never_written_in_the_arrays_held() -> None:
    layer = filled(5, seed=0)
    assert layer.claim_one() == 5 and layer.offset == 6  # fresh capacity: claimed
    layer.trim_to(4)
    assert layer.claim_one() is None and layer.offset == 4  # rewound: position 4 was written (a view may show it)
    layer.update_and_fetch(*kv(1, seed=1))
    layer.update_and_fetch(*kv(1, seed=2))
    assert layer.offset == 6 and layer.claim_one() == 6  # past everything written again
    layer.offset = layer.own_capacity
    assert layer.claim_one() is None  # no room left: append_one raises, as before
    outside = filled(3, seed=3)
    outside.keys, outside.values = kv(8, seed=4)  # arrays set from outside: nothing known about them
    outside.offset = 3
    assert outside.claim_one() is None


def test_host_decode_writes_claimed_positions_and_attends_over_them(backend) -> None:
    rows = [filled(5, seed=0), filled(9, seed=1), filled(2, seed=2)]
    before = [(np.asarray(r.keys).copy(), np.asarray(r.values).copy()) for r in rows]
    got, new_k, new_v, queries = decode_step(backend, rows, seed=3)
    for b, row in enumerate(rows):
        at = row.offset - 1
        np.testing.assert_array_equal(np.asarray(row.keys)[:, :, at], np.asarray(new_k)[b:b + 1, :, 0])
        np.testing.assert_array_equal(np.asarray(row.values)[:, :, at], np.asarray(new_v)[b:b + 1, :, 0])
        np.testing.assert_array_equal(np.asarray(row.keys)[:, :, :at], before[b][0][:, :, :at])
    want = reference(queries, [(r.keys[..., :r.offset, :], r.values[..., :r.offset, :]) for r in rows])
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


def test_a_rewound_row_writes_through_mlx_and_an_earlier_view_keeps_what_it_showed(backend) -> None:
    rewound, fresh = filled(6, seed=0), filled(4, seed=1)
    view = rewound.keys[..., :6, :]
    mx.eval(view)
    shown = np.asarray(view).copy()
    rewound.trim_to(3)  # the next turn diverged at 3: position 3 is rewritten, and `view` still shows the old one
    got, new_k, _, queries = decode_step(backend, [rewound, fresh], seed=2)
    np.testing.assert_array_equal(np.asarray(view), shown)
    np.testing.assert_array_equal(np.asarray(rewound.keys)[:, :, 3], np.asarray(new_k)[0:1, :, 0])
    np.testing.assert_array_equal(np.asarray(fresh.keys)[:, :, 4], np.asarray(new_k)[1:2, :, 0])
    want = reference(queries, [(r.keys[..., :r.offset, :], r.values[..., :r.offset, :]) for r in (rewound, fresh)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


def test_claimed_positions_are_written_through_mlx_when_attention_stays_there(backend, monkeypatch) -> None:
    """Claimed in update_and_fetch, but host_decode does not run this layer (here: sinks): MLX writes them."""
    rows = [filled(5, seed=0), filled(7, seed=1)]
    monkeypatch.setattr(host_decode, "attend", lambda *a: pytest.fail("host_decode ran"))
    rng = np.random.default_rng(4)
    new_k, new_v = (mx.array(rng.standard_normal((2, KV_HEADS, 1, DIM)).astype(np.float32)) for _ in range(2))
    layer = backend.ragged(rows)
    layer.update_and_fetch(new_k, new_v)
    queries = mx.array(rng.standard_normal((2, HEADS, 1, DIM)).astype(np.float32))
    layer.attend(queries, SCALE, None, sinks=mx.zeros((HEADS,)))
    for b, row in enumerate(rows):
        np.testing.assert_array_equal(np.asarray(row.values)[:, :, row.offset - 1], np.asarray(new_v)[b:b + 1, :, 0])


def test_nothing_is_claimed_by_the_mlx_backends_view_or_with_the_loops_off(backend) -> None:
    """There the position is written at once, through MLX (a claimed one is written only when attention runs)."""
    rows = [filled(5, seed=0), filled(7, seed=1)]

    def written_at_once(layer_view) -> bool:
        new_k, new_v = kv(2, seed=len(rows[0].keys.shape) + rows[0].offset)
        new_k, new_v = new_k.transpose(2, 1, 0, 3), new_v.transpose(2, 1, 0, 3)  # (2 rows, heads, 1, dim)
        layer_view(rows).update_and_fetch(new_k, new_v)
        return all(np.array_equal(np.asarray(r.keys)[:, :, r.offset - 1], np.asarray(new_k)[b:b + 1, :, 0])
                   for b, r in enumerate(rows))

    assert written_at_once(RaggedLayerCache)  # the MLX backend's view of a batch's layer
    loops_off = CpuBackend(CpuOptions(decode_loops=False))
    assert written_at_once(loops_off.ragged)
    loops_off.close()
    assert not written_at_once(backend.ragged)  # claimed: left for host_decode's loops
