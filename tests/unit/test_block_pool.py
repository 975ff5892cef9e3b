"""Exact behaviour of the block pool: free-queue order, sharing, accounting, errors."""

from __future__ import annotations

import dataclasses

import pytest

from engine.domain.block_pool import BlockPool, PoolSnapshot
from engine.domain.cache_spec import ModelCacheSpec, group_layers

pytestmark = pytest.mark.unit

GiB = 1 << 30
MiB = 1 << 20


def smollm2_spec() -> ModelCacheSpec:
    """SmolLM2-135M-like: 30 layers, 3 KV heads of 64, float32, uniform attention."""
    return ModelCacheSpec(
        n_layers=30, n_kv_heads=3, head_dim=64, dtype="float32", block_tokens=256,
        groups=group_layers([None] * 30),
    )


def gemma3_spec() -> ModelCacheSpec:
    """Gemma-3-like hybrid: every 6th layer global, the rest a 512-token sliding window."""
    windows: list[int | None] = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    return ModelCacheSpec(
        n_layers=18, n_kv_heads=1, head_dim=256, dtype="bfloat16", block_tokens=256,
        groups=group_layers(windows), layer_windows=tuple(windows),
    )


def state(pool: BlockPool) -> tuple[PoolSnapshot, tuple[int, ...]]:
    """Everything observable about a pool, including the eviction order."""
    return pool.snapshot(), pool.free_queue()


# -- free-queue order -----------------------------------------------------------------
def test_free_queue_order_after_each_step() -> None:
    pool = BlockPool(11, block_bytes=100)
    assert pool.free_queue() == tuple(range(11))

    assert pool.allocate("a", {0: 3}) == {0: [0, 1, 2]}
    assert pool.free_queue() == (3, 4, 5, 6, 7, 8, 9, 10)

    assert pool.allocate("b", {0: 4}) == {0: [3, 4, 5, 6]}
    assert pool.free_queue() == (7, 8, 9, 10)

    # Released tail first: a's block 2 is reused before its block 0.
    assert pool.release("a", [0, 1, 2]) == 3
    assert pool.free_queue() == (7, 8, 9, 10, 2, 1, 0)

    assert pool.allocate("c", {0: 5}) == {0: [7, 8, 9, 10, 2]}
    assert pool.free_queue() == (1, 0)

    assert pool.release_owner("b") == 4
    assert pool.free_queue() == (1, 0, 6, 5, 4, 3)

    assert pool.release("c", [9, 7]) == 2
    assert pool.free_queue() == (1, 0, 6, 5, 4, 3, 7, 9)
    assert pool.blocks_of("c") == (8, 10, 2)


def test_multi_group_allocation_serves_groups_in_index_order() -> None:
    pool = BlockPool(11, block_bytes=100, n_groups=2)
    assert pool.allocate("a", {1: 2, 0: 3}) == {0: [0, 1, 2], 1: [3, 4]}
    assert [pool.group_of(b) for b in range(6)] == [0, 0, 0, 1, 1, None]
    assert pool.blocks_of("a") == (0, 1, 2, 3, 4)

    assert pool.release_owner("a") == 5
    assert pool.free_queue() == (5, 6, 7, 8, 9, 10, 4, 3, 2, 1, 0)
    assert pool.group_of(3) is None


def test_zero_block_groups_allocate_nothing_and_create_no_owner() -> None:
    pool = BlockPool(4, block_bytes=1, n_groups=2)
    assert pool.allocate("a", {0: 0, 1: 0}) == {0: [], 1: []}
    assert pool.allocate("a", {}) == {}
    assert pool.owners() == ()
    assert pool.free_queue() == (0, 1, 2, 3)


def test_release_owner_of_unknown_owner_frees_nothing() -> None:
    pool = BlockPool(4, block_bytes=1)
    assert pool.release_owner("ghost") == 0
    assert pool.release("ghost", []) == 0


# -- all or nothing -------------------------------------------------------------------
def test_failed_multi_group_allocation_changes_nothing() -> None:
    pool = BlockPool(11, block_bytes=100, n_groups=2)
    pool.allocate("a", {0: 5, 1: 5})
    before = state(pool)

    # Group 0 alone would fit in the one free block; the pair must not.
    assert pool.allocate("b", {0: 1, 1: 1}) is None
    assert state(pool) == before
    assert pool.owners() == ("a",)

    assert pool.allocate("b", {1: 1}) == {1: [10]}


def test_invalid_request_changes_nothing() -> None:
    pool = BlockPool(11, block_bytes=100, n_groups=2)
    pool.allocate("a", {0: 2})
    before = state(pool)
    for request in ({0: 1, 2: 1}, {0: 1, 1: -1}, {0: True}, {"0": 1}, {0: 1.0}):
        with pytest.raises(ValueError):
            pool.allocate("b", request)
        assert state(pool) == before


def test_allocation_exactly_filling_the_pool_succeeds() -> None:
    pool = BlockPool(5, block_bytes=1, n_groups=2)
    assert pool.allocate("a", {0: 3, 1: 2}) == {0: [0, 1, 2], 1: [3, 4]}
    assert pool.free_blocks == 0
    assert pool.allocate("b", {0: 1}) is None
    assert pool.pressure == 1.0


# -- sharing ----------------------------------------------------------------------------
def test_shared_prefix_survives_until_last_holder_releases() -> None:
    pool = BlockPool(11, block_bytes=100)
    pool.allocate("a", {0: 4})
    pool.share([0, 1], "b")

    assert pool.holders(0) == ("a", "b")
    assert pool.refcount(0) == 2
    assert pool.refcount(2) == 1
    assert pool.shared_blocks == 2
    assert pool.owned_blocks("a") == 4
    assert pool.owned_blocks("b") == 2
    assert pool.exclusive_blocks("a") == 2
    assert pool.exclusive_blocks("b") == 0
    assert pool.used_blocks == 4

    assert pool.release_owner("a") == 2
    assert pool.free_queue() == (4, 5, 6, 7, 8, 9, 10, 3, 2)
    assert pool.holders(0) == ("b",)
    assert pool.shared_blocks == 0
    assert pool.exclusive_blocks("b") == 2
    assert pool.snapshot().block_owner[:2] == ("b", "b")

    assert pool.release("b", [0, 1]) == 2
    assert pool.free_queue()[-2:] == (1, 0)
    assert pool.refcount(0) == 0
    assert pool.holders(0) == ()


def test_release_of_a_shared_block_frees_nothing() -> None:
    pool = BlockPool(4, block_bytes=1)
    pool.allocate("a", {0: 2})
    pool.share([0], "b")
    assert pool.release("a", [0]) == 0
    assert pool.free_queue() == (2, 3)
    assert pool.blocks_of("a") == (1,)
    assert pool.blocks_of("b") == (0,)


def test_share_errors_leave_state_unchanged() -> None:
    pool = BlockPool(4, block_bytes=1)
    pool.allocate("a", {0: 2})
    pool.share([0], "b")
    before = state(pool)
    with pytest.raises(ValueError, match="block 2 is free"):
        pool.share([1, 2], "c")
    with pytest.raises(ValueError, match="block 0 is already held by 'b'"):
        pool.share([1, 0], "b")
    with pytest.raises(ValueError, match="duplicate block ids"):
        pool.share([1, 1], "c")
    with pytest.raises(ValueError, match="out of range 0..3"):
        pool.share([4], "c")
    assert state(pool) == before
    assert pool.owners() == ("a", "b")


def test_release_errors_leave_state_unchanged() -> None:
    pool = BlockPool(4, block_bytes=1)
    pool.allocate("a", {0: 2})
    before = state(pool)
    with pytest.raises(ValueError, match=r"'a' does not hold blocks \[2\]"):
        pool.release("a", [1, 2])
    with pytest.raises(ValueError, match="does not hold"):
        pool.release("b", [0])
    with pytest.raises(ValueError, match="duplicate"):
        pool.release("a", [0, 0])
    assert state(pool) == before


# -- accounting -------------------------------------------------------------------------
def test_byte_accounting_and_pressure() -> None:
    pool = BlockPool(10, block_bytes=1024)
    assert (pool.total_bytes, pool.used_bytes, pool.free_bytes) == (10240, 0, 10240)
    assert pool.pressure == 0.0

    pool.allocate("a", {0: 3})
    pool.share([0, 1, 2], "b")  # sharing costs no memory
    assert (pool.used_blocks, pool.free_blocks) == (3, 7)
    assert (pool.used_bytes, pool.free_bytes) == (3072, 7168)
    assert pool.pressure == pytest.approx(0.3)
    assert pool.can_allocate(7) and not pool.can_allocate(8)


def test_snapshot_values() -> None:
    pool = BlockPool(6, block_bytes=10, n_groups=2)
    pool.allocate("a", {0: 2, 1: 1})
    pool.allocate("b", {1: 1})
    pool.share([0], "b")
    snap = pool.snapshot()

    assert snap == PoolSnapshot(
        total_blocks=6, used_blocks=4, block_bytes=10, n_groups=2, shared_blocks=1,
        owner_blocks={"a": 3, "b": 2},
        block_owner=("a", "a", "a", "b", None, None),
        block_group=(0, 0, 1, 1, None, None),
        block_holders=(2, 1, 1, 1, 0, 0),
        block_holder_ids=(("a", "b"), ("a",), ("a",), ("b",), (), ()),
    )
    assert (snap.free_blocks, snap.used_bytes, snap.free_bytes, snap.total_bytes) == (2, 40, 20, 60)
    assert snap.pressure == pytest.approx(4 / 6)


def test_snapshot_is_immutable_and_detached() -> None:
    pool = BlockPool(4, block_bytes=1)
    pool.allocate("a", {0: 1})
    snap = pool.snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.used_blocks = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.owner_blocks["a"] = 9  # type: ignore[index]
    pool.allocate("a", {0: 1})
    assert snap.owner_blocks == {"a": 1}
    assert snap.block_owner == ("a", None, None, None)


# -- sizing from a cache spec -------------------------------------------------------------
def test_from_budget_uniform_model() -> None:
    spec = smollm2_spec()
    assert spec.block_bytes == 11_796_480
    pool = BlockPool.from_budget(spec, GiB)
    # 1 GiB / 11,796,480 B = 91.02 blocks.
    assert (pool.total_blocks, pool.block_bytes, pool.n_groups) == (91, 11_796_480, 1)
    assert pool.total_bytes == 91 * 11_796_480


def test_from_budget_hybrid_model_tags_sliding_groups() -> None:
    spec = gemma3_spec()
    assert [g.kind for g in spec.groups] == ["global"] + ["sliding-512"] * 5
    assert spec.block_bytes == 786_432
    pool = BlockPool.from_budget(spec, 100 * MiB)
    assert (pool.total_blocks, pool.n_groups) == (133, 6)

    request = spec.blocks_per_group_for_tokens(1000)
    assert request == {0: 4, 1: 3, 2: 3, 3: 3, 4: 3, 5: 3}
    got = pool.allocate("agent", request)
    assert got is not None
    assert got[0] == [0, 1, 2, 3] and got[1] == [4, 5, 6]
    groups = pool.snapshot().block_group
    sliding = [b for b, g in enumerate(groups) if g is not None and spec.groups[g].is_sliding]
    assert sliding == list(range(4, 19))
    assert pool.used_bytes == spec.bytes_for_tokens(1000)


def test_from_budget_too_small_names_the_numbers() -> None:
    spec = gemma3_spec()
    with pytest.raises(ValueError) as err:
        BlockPool.from_budget(spec, 5 * 786_432)
    message = str(err.value)
    for number in ("3,932,160", "5 blocks", "786,432", "6 layer groups", "4,718,592"):
        assert number in message
    with pytest.raises(ValueError, match="budget_bytes must be a non-negative int"):
        BlockPool.from_budget(spec, -1)


# -- model swap ---------------------------------------------------------------------------
def test_resize_only_when_empty() -> None:
    pool = BlockPool(4, block_bytes=8, n_groups=2)
    pool.allocate("a", {0: 1})
    with pytest.raises(RuntimeError, match="cannot resize the block pool while 1 blocks"):
        pool.resize(8)
    pool.release_owner("a")
    pool.resize(8)
    assert (pool.total_blocks, pool.block_bytes, pool.n_groups) == (8, 8, 2)
    assert pool.free_queue() == tuple(range(8))
    with pytest.raises(ValueError, match="total_blocks must be an int >= n_groups"):
        pool.resize(1)


def test_reconfigure_for_another_model() -> None:
    pool = BlockPool.from_budget(smollm2_spec(), GiB)
    pool.allocate("a", {0: 2})
    pool.share([0], "b")
    with pytest.raises(RuntimeError, match="while 2 blocks are in use by 2 owners"):
        pool.reconfigure(gemma3_spec(), 100 * MiB)
    assert pool.total_blocks == 91

    pool.release_owner("a")
    pool.release_owner("b")
    pool.reconfigure(gemma3_spec(), 100 * MiB)
    assert (pool.total_blocks, pool.block_bytes, pool.n_groups) == (133, 786_432, 6)
    assert pool.free_queue() == tuple(range(133))
    assert pool.snapshot().block_owner == (None,) * 133


def test_reconfigure_with_too_small_budget_keeps_old_layout() -> None:
    pool = BlockPool(4, block_bytes=8)
    with pytest.raises(ValueError, match="need at least 6 blocks"):
        pool.reconfigure(gemma3_spec(), 786_432)
    assert (pool.total_blocks, pool.block_bytes, pool.n_groups) == (4, 8, 1)


# -- input validation -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 8, 1), "total_blocks must be an int >= n_groups"),
        ((2, 8, 3), r"total_blocks must be an int >= n_groups \(3\)"),
        ((4, 0, 1), "block_bytes must be a positive int"),
        ((4, 8, 0), "n_groups must be a positive int"),
        ((4.0, 8, 1), "total_blocks must be an int"),
    ],
)
def test_constructor_rejects_bad_shapes(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockPool(*args)


def test_allocate_error_messages() -> None:
    pool = BlockPool(4, block_bytes=1, n_groups=2)
    with pytest.raises(ValueError, match=r"unknown layer group 2: pool has 2 groups \(0..1\)"):
        pool.allocate("a", {2: 1})
    with pytest.raises(ValueError, match="count for group 1 must be a non-negative int, got -1"):
        pool.allocate("a", {1: -1})
    with pytest.raises(ValueError, match="owner must be a non-empty string"):
        pool.allocate("", {0: 1})
    with pytest.raises(ValueError, match="request must map group index"):
        pool.allocate("a", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_blocks must be a non-negative int"):
        pool.can_allocate(-1)


def test_queries_reject_out_of_range_blocks() -> None:
    pool = BlockPool(4, block_bytes=1)
    for query in (pool.holders, pool.refcount, pool.group_of):
        with pytest.raises(ValueError, match="block id -1 out of range 0..3"):
            query(-1)
    assert pool.blocks_of("nobody") == ()
    assert pool.owned_blocks("nobody") == 0
    assert pool.exclusive_blocks("nobody") == 0
