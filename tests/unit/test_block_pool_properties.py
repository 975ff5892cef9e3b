"""Block pool invariants under random operation sequences and concurrent readers."""

from __future__ import annotations

import random
import sys
import threading
from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.domain.block_pool import BlockPool, PoolSnapshot

pytestmark = pytest.mark.unit

OWNERS = ("a", "b", "c", "d")


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool and a plain-Python model of it side by side.

    The model keeps the exact free-queue order, so every step also checks the
    eviction policy: take from the head, release the given blocks tail first.
    """

    pool: BlockPool

    @initialize(n_groups=st.integers(1, 3), extra=st.integers(0, 13))
    def make_pool(self, n_groups: int, extra: int) -> None:
        total = n_groups + extra
        self.pool = BlockPool(total, block_bytes=64, n_groups=n_groups)
        self.free: deque[int] = deque(range(total))
        self.holders: dict[int, list[str]] = {}
        self.group: dict[int, int] = {}
        self.owned: dict[str, list[int]] = {}

    def observed(self) -> tuple[PoolSnapshot, tuple[int, ...]]:
        return self.pool.snapshot(), self.pool.free_queue()

    # -- rules ------------------------------------------------------------------------
    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def allocate(self, owner: str, data: st.DataObject) -> None:
        groups = st.integers(0, self.pool.n_groups - 1)
        request = data.draw(st.dictionaries(groups, st.integers(0, 6), max_size=3))
        before = self.observed()
        result = self.pool.allocate(owner, request)
        if sum(request.values()) > len(self.free):
            assert result is None
            assert self.observed() == before
            return
        assert result == {g: self.model_take(owner, g, n) for g, n in sorted(request.items())}

    def model_take(self, owner: str, group: int, n_blocks: int) -> list[int]:
        taken = [self.free.popleft() for _ in range(n_blocks)]
        for block in taken:
            self.holders[block] = [owner]
            self.group[block] = group
        if taken:
            self.owned.setdefault(owner, []).extend(taken)
        return taken

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def allocate_invalid(self, owner: str, data: st.DataObject) -> None:
        bad = data.draw(
            st.sampled_from([{self.pool.n_groups: 1}, {0: -1}, {-1: 1}, {0: True}])
        )
        before = self.observed()
        with pytest.raises(ValueError):
            self.pool.allocate(owner, {0: 1, **bad})
        assert self.observed() == before

    @precondition(lambda self: self.holders)
    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def share(self, owner: str, data: st.DataObject) -> None:
        candidates = sorted(b for b, h in self.holders.items() if owner not in h)
        if not candidates:
            return
        blocks = data.draw(st.lists(st.sampled_from(candidates), min_size=1, unique=True))
        self.pool.share(blocks, owner)
        for block in blocks:
            self.holders[block].append(owner)
        self.owned.setdefault(owner, []).extend(blocks)

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def share_invalid(self, owner: str, data: st.DataObject) -> None:
        bad = [b for b in range(self.pool.total_blocks) if owner in self.holders.get(b, [owner])]
        if not bad:
            return
        block = data.draw(st.sampled_from(bad))
        before = self.observed()
        with pytest.raises(ValueError):
            self.pool.share([block], owner)
        assert self.observed() == before

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.owned)))
        order = data.draw(st.permutations(self.owned[owner]))
        blocks = order[: data.draw(st.integers(0, len(order)))]
        assert self.pool.release(owner, blocks) == self.model_drop(owner, blocks)

    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner: str) -> None:
        blocks = list(self.owned.get(owner, []))
        assert self.pool.release_owner(owner) == self.model_drop(owner, blocks)

    def model_drop(self, owner: str, blocks: list[int]) -> int:
        freed = 0
        for block in reversed(blocks):
            self.owned[owner].remove(block)
            self.holders[block].remove(owner)
            if not self.holders[block]:
                del self.holders[block], self.group[block]
                self.free.append(block)
                freed += 1
        if owner in self.owned and not self.owned[owner]:
            del self.owned[owner]
        return freed

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def counts_add_up(self) -> None:
        pool = self.pool
        assert pool.used_blocks + pool.free_blocks == pool.total_blocks
        assert pool.used_blocks == len(self.holders)
        assert pool.used_bytes + pool.free_bytes == pool.total_bytes

    @invariant()
    def free_queue_matches_model(self) -> None:
        queue = self.pool.free_queue()
        assert len(set(queue)) == len(queue)
        assert queue == tuple(self.free)

    @invariant()
    def holders_match_model(self) -> None:
        for block in range(self.pool.total_blocks):
            expected = tuple(self.holders.get(block, ()))
            assert self.pool.holders(block) == expected
            assert self.pool.refcount(block) == len(expected)
            assert self.pool.group_of(block) == self.group.get(block)

    @invariant()
    def owners_match_model(self) -> None:
        assert set(self.pool.owners()) == set(self.owned)
        for owner in OWNERS:
            blocks = self.owned.get(owner, [])
            assert self.pool.blocks_of(owner) == tuple(blocks)
            assert self.pool.owned_blocks(owner) == len(blocks)
            alone = sum(1 for b in blocks if len(self.holders[b]) == 1)
            assert self.pool.exclusive_blocks(owner) == alone

    @invariant()
    def snapshot_matches_model(self) -> None:
        snap = self.pool.snapshot()
        blocks = range(snap.total_blocks)
        assert snap.block_owner == tuple(self.holders.get(b, [None])[0] for b in blocks)
        assert snap.block_group == tuple(self.group.get(b) for b in blocks)
        assert dict(snap.owner_blocks) == {o: len(b) for o, b in self.owned.items()}
        assert snap.shared_blocks == sum(1 for h in self.holders.values() if len(h) > 1)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- concurrency ------------------------------------------------------------------------------
def assert_consistent(snap: PoolSnapshot) -> None:
    """What a reader may rely on in any snapshot, whatever the writer is doing."""
    in_use = [owner for owner in snap.block_owner if owner is not None]
    assert len(in_use) == snap.used_blocks
    assert snap.used_blocks + snap.free_blocks == snap.total_blocks
    assert [g is None for g in snap.block_group] == [o is None for o in snap.block_owner]
    held = sum(snap.owner_blocks.values())
    # Each block counts once per holder; only shared blocks count more than once.
    assert held >= snap.used_blocks
    assert held == snap.used_blocks or snap.shared_blocks > 0
    assert snap.shared_blocks <= snap.used_blocks
    for owner in set(in_use):
        assert in_use.count(owner) <= snap.owner_blocks[owner]


def write_randomly(pool: BlockPool, steps: int) -> None:
    rng = random.Random(1234)
    owners = [f"agent-{i}" for i in range(16)]
    for _ in range(steps):
        owner = rng.choice(owners)
        roll = rng.random()
        if roll < 0.5:
            pool.allocate(owner, {g: rng.randint(0, 8) for g in range(pool.n_groups)})
        elif roll < 0.65 and pool.used_blocks:
            donor = pool.blocks_of(rng.choice(owners))
            mine = set(pool.blocks_of(owner))
            pool.share([b for b in donor[:4] if b not in mine], owner)
        elif roll < 0.85:
            blocks = pool.blocks_of(owner)
            pool.release(owner, blocks[len(blocks) // 2 :])
        else:
            pool.release_owner(owner)


def test_snapshots_stay_consistent_while_a_writer_hammers_the_pool() -> None:
    pool = BlockPool(512, block_bytes=4096, n_groups=2)
    done = threading.Event()
    failures: list[BaseException] = []
    snapshots_taken = [0]

    def read() -> None:
        try:
            while not done.is_set():
                assert_consistent(pool.snapshot())
                snapshots_taken[0] += 1
        except BaseException as exc:  # noqa: BLE001 - surfaced in the main thread
            failures.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # force many thread switches mid-operation
    readers = [threading.Thread(target=read) for _ in range(3)]
    try:
        for thread in readers:
            thread.start()
        write_randomly(pool, steps=10_000)
    finally:
        done.set()
        for thread in readers:
            thread.join()
        sys.setswitchinterval(old_interval)

    assert not failures, failures[0]
    assert snapshots_taken[0] > 10
    final = pool.snapshot()
    assert_consistent(final)
    assert final.used_blocks == pool.total_blocks - len(pool.free_queue())
