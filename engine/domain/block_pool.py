"""The block pool: KV-cache memory accounted in fixed-size blocks.

Every block has the same byte size, the cache spec's unit (``cache_spec``: a
layer group's block is a whole number of them) and, while in use, serves
exactly one layer group. Blocks are the ints ``0 .. total_blocks - 1``.

Free-queue order (the eviction policy, as in vLLM v1): allocation takes blocks
from the head of the free queue; a released block is appended to the tail. A
release frees blocks in *reverse* of the order given, so the tail of a sequence
goes back first and is reused before its head, which is the part most likely
to be shared as a prefix again.

Agents may share prefix blocks, so a block has an ordered list of holders and
returns to the free queue only when its last holder releases it.

Threading: one engine thread mutates; UI and HTTP threads read. Every mutation
and every multi-field read takes one lock, so a check and the act it guards
(fits? then take) can never interleave with another writer, and a snapshot is
always internally consistent.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from engine.domain.cache_spec import ModelCacheSpec


@dataclass(slots=True, frozen=True)
class PoolSnapshot:
    """A consistent, immutable picture of the pool for stats and the UI's pool map."""

    total_blocks: int
    used_blocks: int
    block_bytes: int
    n_groups: int
    shared_blocks: int
    owner_blocks: Mapping[str, int]
    block_owner: tuple[str | None, ...]  # the first holder of each block
    block_group: tuple[int | None, ...]
    block_holders: tuple[int, ...] = ()  # holders of each block: above 1, a shared prefix block
    block_holder_ids: tuple[tuple[str, ...], ...] = ()  # who holds each block (the first is block_owner)

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    @property
    def total_bytes(self) -> int:
        return self.total_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    @property
    def free_bytes(self) -> int:
        return self.free_blocks * self.block_bytes

    @property
    def pressure(self) -> float:
        return self.used_blocks / self.total_blocks


class BlockPool:
    """Fixed-size KV blocks with per-owner reference counts and a FIFO free queue."""

    def __init__(self, total_blocks: int, block_bytes: int, n_groups: int = 1) -> None:
        _check_shape(total_blocks, block_bytes, n_groups)
        self._lock = threading.Lock()
        self._reset(total_blocks, block_bytes, n_groups)

    @classmethod
    def from_budget(cls, spec: ModelCacheSpec, budget_bytes: int) -> BlockPool:
        """As many blocks of ``spec.block_bytes`` as fit in ``budget_bytes``."""
        total = _blocks_in_budget(spec, budget_bytes)
        return cls(total, spec.block_bytes, len(spec.groups))

    def _reset(self, total_blocks: int, block_bytes: int, n_groups: int) -> None:
        self._total = total_blocks
        self._block_bytes = block_bytes
        self._n_groups = n_groups
        self._free: deque[int] = deque(range(total_blocks))
        # Holders in the order they took the block; an empty list means free.
        self._holders: list[list[str]] = [[] for _ in range(total_blocks)]
        self._group: list[int | None] = [None] * total_blocks
        # dicts as ordered sets: O(1) removal and allocation order kept for release_owner.
        self._owned: dict[str, dict[int, None]] = {}
        self._shared = 0
        # The snapshot's per-block maps, kept up to date as blocks change hands: a snapshot copies them (C-level
        # tuple copies) instead of walking every block in Python, and is reused until a block changes. A pool of a
        # tiny model holds a million blocks, and the engine publishes a snapshot every step.
        self._first_holder: list[str | None] = [None] * total_blocks
        self._holder_count: list[int] = [0] * total_blocks
        self._holder_ids: list[tuple[str, ...]] = [()] * total_blocks
        self._snapshot: PoolSnapshot | None = None

    # -- sizes ---------------------------------------------------------------------
    @property
    def total_blocks(self) -> int:
        return self._total

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def n_groups(self) -> int:
        return self._n_groups

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self._total - len(self._free)

    @property
    def shared_blocks(self) -> int:
        """Blocks held by two or more owners."""
        return self._shared

    @property
    def total_bytes(self) -> int:
        return self._total * self._block_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self._block_bytes

    @property
    def free_bytes(self) -> int:
        return self.free_blocks * self._block_bytes

    @property
    def pressure(self) -> float:
        """Fraction of blocks in use, 0.0 (empty) to 1.0 (full)."""
        return self.used_blocks / self._total

    def can_allocate(self, n_blocks: int) -> bool:
        _check_count(n_blocks, "n_blocks")
        return n_blocks <= len(self._free)

    # -- allocation ------------------------------------------------------------------
    def allocate(self, owner: str, request: Mapping[int, int]) -> dict[int, list[int]] | None:
        """Take ``request[group]`` blocks per layer group for ``owner``, all or nothing.

        Groups are served in ascending index order. Returns None, leaving the
        pool untouched, when the free queue cannot cover the whole request:
        "cannot schedule now" is a normal outcome, not an error.
        """
        _check_owner(owner)
        counts = self._checked_request(request)
        with self._lock:
            if sum(n for _, n in counts) > len(self._free):
                return None
            return {group: self._take(owner, group, n) for group, n in counts}

    def _take(self, owner: str, group: int, n_blocks: int) -> list[int]:
        if n_blocks == 0:
            return []
        popleft = self._free.popleft
        taken = [popleft() for _ in range(n_blocks)]
        for block in taken:
            self._holders[block].append(owner)
            self._group[block] = group
            self._changed(block)
        self._owned.setdefault(owner, {}).update(dict.fromkeys(taken))
        return taken

    def _changed(self, block: int) -> None:
        """``block``'s holders changed: its entries in the snapshot's maps follow (caller holds the lock)."""
        holders = self._holders[block]
        self._first_holder[block] = holders[0] if holders else None
        self._holder_count[block] = len(holders)
        self._holder_ids[block] = tuple(holders)
        self._snapshot = None

    def share(self, block_ids: Iterable[int], owner: str) -> None:
        """Add ``owner`` as a holder of blocks already in use (a shared prefix)."""
        _check_owner(owner)
        ids = self._checked_ids(block_ids)
        with self._lock:
            for block in ids:
                self._check_shareable(block, owner)
            if ids:
                self._add_holder(ids, owner)

    def _check_shareable(self, block: int, owner: str) -> None:
        holders = self._holders[block]
        if not holders:
            raise ValueError(f"block {block} is free: only blocks in use can be shared")
        if owner in holders:
            raise ValueError(f"block {block} is already held by {owner!r}")

    def _add_holder(self, ids: list[int], owner: str) -> None:
        owned = self._owned.setdefault(owner, {})
        for block in ids:
            holders = self._holders[block]
            if len(holders) == 1:
                self._shared += 1
            holders.append(owner)
            owned[block] = None
            self._changed(block)

    # -- release ------------------------------------------------------------------------
    def release(self, owner: str, block_ids: Iterable[int]) -> int:
        """Drop ``owner``'s hold on ``block_ids``; returns how many blocks became free.

        Blocks are released in reverse of the order given, so pass a sequence's
        blocks head first and its tail is reused first.
        """
        ids = self._checked_ids(block_ids)
        if not ids:
            return 0
        with self._lock:
            owned = self._owned.get(owner, {})
            not_held = [block for block in ids if block not in owned]
            if not_held:
                raise ValueError(f"{owner!r} does not hold blocks {not_held}")
            return self._drop(owner, ids)

    def release_owner(self, owner: str) -> int:
        """Drop every hold of ``owner`` (newest first); returns how many blocks became free."""
        with self._lock:
            ids = list(self._owned.get(owner, ()))
            return self._drop(owner, ids) if ids else 0

    def _drop(self, owner: str, ids: list[int]) -> int:
        owned = self._owned[owner]
        freed = 0
        for block in reversed(ids):
            del owned[block]
            holders = self._holders[block]
            holders.remove(owner)
            if not holders:
                self._group[block] = None
                self._free.append(block)
                freed += 1
            elif len(holders) == 1:
                self._shared -= 1
            self._changed(block)
        if not owned:
            del self._owned[owner]
        return freed

    # -- queries ------------------------------------------------------------------------
    def holders(self, block_id: int) -> tuple[str, ...]:
        self._check_block(block_id)
        with self._lock:
            return tuple(self._holders[block_id])

    def refcount(self, block_id: int) -> int:
        self._check_block(block_id)
        return len(self._holders[block_id])

    def group_of(self, block_id: int) -> int | None:
        """The layer group a block serves, or None while it is free."""
        self._check_block(block_id)
        return self._group[block_id]

    def blocks_of(self, owner: str) -> tuple[int, ...]:
        """Blocks ``owner`` holds, in the order it took them."""
        with self._lock:
            return tuple(self._owned.get(owner, ()))

    def owned_blocks(self, owner: str) -> int:
        with self._lock:
            return len(self._owned.get(owner, ()))

    def exclusive_blocks(self, owner: str) -> int:
        """Blocks held by ``owner`` alone: what evicting that owner would free."""
        with self._lock:
            owned = self._owned.get(owner, ())
            return sum(1 for block in owned if len(self._holders[block]) == 1)

    def owners(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._owned)

    def free_queue(self) -> tuple[int, ...]:
        """Free blocks in the order allocation will take them (head first)."""
        with self._lock:
            return tuple(self._free)

    def snapshot(self) -> PoolSnapshot:
        with self._lock:
            if self._snapshot is None:
                self._snapshot = PoolSnapshot(
                    total_blocks=self._total,
                    used_blocks=self._total - len(self._free),
                    block_bytes=self._block_bytes,
                    n_groups=self._n_groups,
                    shared_blocks=self._shared,
                    owner_blocks=MappingProxyType({o: len(b) for o, b in self._owned.items()}),
                    block_owner=tuple(self._first_holder),
                    block_group=tuple(self._group),
                    block_holders=tuple(self._holder_count),
                    block_holder_ids=tuple(self._holder_ids),
                )
            return self._snapshot

    # -- model swap -----------------------------------------------------------------------
    def resize(self, total_blocks: int) -> None:
        """Change the block count, keeping block size and groups; only while empty."""
        _check_shape(total_blocks, self._block_bytes, self._n_groups)
        with self._lock:
            self._check_empty("resize")
            self._reset(total_blocks, self._block_bytes, self._n_groups)

    def reconfigure(self, spec: ModelCacheSpec, budget_bytes: int) -> None:
        """Re-lay the pool for another model's cache spec; only while empty."""
        total = _blocks_in_budget(spec, budget_bytes)
        with self._lock:
            self._check_empty("reconfigure")
            self._reset(total, spec.block_bytes, len(spec.groups))

    def _check_empty(self, action: str) -> None:
        # Live block ids would point into a layout that no longer exists.
        used = self._total - len(self._free)
        if used:
            raise RuntimeError(
                f"cannot {action} the block pool while {used} blocks are in use "
                f"by {len(self._owned)} owners: release them first"
            )

    # -- validation -----------------------------------------------------------------------
    def _checked_request(self, request: Mapping[int, int]) -> list[tuple[int, int]]:
        if not isinstance(request, Mapping):
            raise ValueError(f"request must map group index to block count, got {request!r}")
        for group, n_blocks in request.items():
            if not _is_int(group) or not 0 <= group < self._n_groups:
                raise ValueError(
                    f"unknown layer group {group!r}: pool has {self._n_groups} groups "
                    f"(0..{self._n_groups - 1})"
                )
            _check_count(n_blocks, f"block count for group {group}")
        return sorted(request.items())

    def _checked_ids(self, block_ids: Iterable[int]) -> list[int]:
        ids = list(block_ids)
        for block in ids:
            self._check_block(block)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in {ids}")
        return ids

    def _check_block(self, block_id: int) -> None:
        if not _is_int(block_id) or not 0 <= block_id < self._total:
            raise ValueError(f"block id {block_id!r} out of range 0..{self._total - 1}")


def _blocks_in_budget(spec: ModelCacheSpec, budget_bytes: int) -> int:
    _check_count(budget_bytes, "budget_bytes")
    total = budget_bytes // spec.block_bytes
    n_groups = len(spec.groups)
    needed = sum(spec.group_units(g) for g in spec.groups)  # one block of every group
    if total < needed:
        raise ValueError(
            f"KV budget of {budget_bytes:,} bytes holds {total} blocks of "
            f"{spec.block_bytes:,} bytes, but the model's {n_groups} layer groups need at "
            f"least {needed} blocks ({needed * spec.block_bytes:,} bytes)"
        )
    return total


def _check_shape(total_blocks: int, block_bytes: int, n_groups: int) -> None:
    if not _is_int(n_groups) or n_groups < 1:
        raise ValueError(f"n_groups must be a positive int, got {n_groups!r}")
    if not _is_int(block_bytes) or block_bytes < 1:
        raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
    # Fewer blocks than groups could never hold even a one-token sequence.
    if not _is_int(total_blocks) or total_blocks < n_groups:
        raise ValueError(
            f"total_blocks must be an int >= n_groups ({n_groups}), got {total_blocks!r}"
        )


def _check_owner(owner: str) -> None:
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"owner must be a non-empty string, got {owner!r}")


def _check_count(n: int, what: str) -> None:
    if not _is_int(n) or n < 0:
        raise ValueError(f"{what} must be a non-negative int, got {n!r}")


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as a block count is a bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)
