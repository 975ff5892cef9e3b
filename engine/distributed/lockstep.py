"""Every rank runs the same engine; rank 0 decides, the others replay its decisions in order.

A sharded model needs every rank to run the same forward passes on the same
batches, and each rank's block pool to hold its shard of the same blocks. The
engine is deterministic given its inputs, so rank 0 shares only the inputs:
once per pass of the engine loop it sends a ``Tick`` (what the API asked for
since the last one: turns submitted and cancelled, agents evicted, pinned,
forked; rank 0's clock; whether to stop), and every rank applies it before
the same admission and step. Disk reads and writes are synchronous under
lockstep, so an I/O thread's timing cannot make ranks decide differently.

Each tick also gathers every rank's report: the state its last step left
(blocks in use, sequences running, tokens made) and its memory. Every rank
compares all the digests, so a rank that diverged stops every rank at the
same tick, rather than generate from a cache that no longer matches its peers'.

An idle server pauses between ticks. A rank waiting inside a collective
spins (MLX's ring backend polls its sockets), so a follower that entered the
next tick at once burned most of a core for nothing while rank 0 waited for
commands. Each tick says how long rank 0 will wait before the next
(``pause_s``, 0 while there is work): rank 0 waits that long for commands,
and the others sleep it out before they enter the next tick.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.distributed.world import World


class LockstepError(RuntimeError):
    """The ranks cannot or no longer run the same engine (settings differ, states diverged)."""


class OpKind(str, enum.Enum):
    SUBMIT = "submit"  # args: (request, submitted_at)
    CANCEL = "cancel"  # args: (request_id, reason)
    CALL = "call"  # args: (EngineOp,)
    CANCEL_ALL = "cancel_all"  # args: (reason,)


@dataclass(frozen=True, slots=True)
class ReplicatedOp:
    kind: OpKind
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Tick:
    ops: tuple[ReplicatedOp, ...]
    now: float  # rank 0's monotonic clock: every rank's decisions read it (runtime/clock.py)
    stop: bool
    digest: tuple[Any, ...]  # rank 0's state after its previous step
    pause_s: float = 0.0  # how long every rank waits before the next tick (idle: see the module's docstring)


@dataclass(frozen=True, slots=True)
class RankReport:
    """What a rank tells the others each tick: its state after its last step, and its memory."""

    rank: int
    digest: tuple[Any, ...]
    active_bytes: int
    peak_bytes: int


@dataclass
class Lockstep:
    """One engine's side of the exchange: rank 0 sends ticks, the others receive them."""

    world: World
    ticks: int = 0
    reports: tuple[RankReport, ...] = ()  # every rank's, from the last tick (the workbench shows them)
    _pending: list[ReplicatedOp] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.world.is_root

    def record(self, kind: OpKind, *args: Any) -> None:
        """Rank 0: an input the others must apply in this order (sent with the next tick)."""
        if self.is_root:
            self._pending.append(ReplicatedOp(kind, args))

    def exchange(self, now: float, stop: bool, digest: tuple[Any, ...], pause_s: float = 0.0) -> Tick:
        """One tick: rank 0's inputs to every rank, every rank's report to every rank.

        Every rank compares all digests, so a diverged rank stops the run on every rank at the same
        tick, with the same message. Raises PeerLostError, LockstepError.
        """
        pending, self._pending = tuple(self._pending), []
        # The decode step launched last is still in flight, with the model's own all_sums. A second
        # collective beside them is unordered across ranks, and when a peer dies MLX then waits
        # forever instead of raising: let the step finish first (its host work already overlapped).
        mx.synchronize()
        report = RankReport(self.world.rank, digest, mx.get_active_memory(), mx.get_peak_memory())
        tick = Tick(pending, now, stop, digest, 0.0 if pending else pause_s)
        mine: Any = (tick, report) if self.is_root else report
        everyone = self.world.gather(mine)
        tick, root_report = everyone[0]
        self.reports = (root_report, *everyone[1:])
        self.ticks += 1
        for other in self.reports[1:]:
            if other.digest != tick.digest:
                raise LockstepError(
                    f"rank {other.rank} diverged from rank 0 at tick {self.ticks}: rank 0 has {tick.digest}, rank "
                    f"{other.rank} has {other.digest} (a disk write that failed on one rank only can do this)"
                )
        return tick

    # -- start-up agreements --------------------------------------------------------------------
    def agree(self, what: str, value: Any) -> None:
        """Every rank must hold the same ``value`` (pool size, batch limits): else stop, naming who differs."""
        values = self.world.gather(value)
        odd = [rank for rank, v in enumerate(values) if v != values[0]]
        if odd:
            ranks = ", ".join(str(r) for r in odd)
            raise LockstepError(f"{what} differs between ranks: rank 0 has {values[0]!r}, rank(s) {ranks} "
                                f"have {[values[r] for r in odd]!r}; start every rank with the same settings")

    def common(self, local: dict[str, Any]) -> set[str]:
        """The keys whose values are equal on every rank (caches whose every shard is present and alike)."""
        everyone = self.world.gather(local)
        return {key for key, value in local.items() if all(other.get(key) == value for other in everyone)}

    def share(self, value: Any = None) -> Any:
        """Rank 0's ``value`` on every rank (the others' is ignored)."""
        return self.world.share(value)
