"""The processes one sharded model runs on, and the few collectives the engine needs between them.

Everything travels through MLX's own distributed backend (``mx.distributed``:
the ring backend over TCP, JACCL over Thunderbolt, MPI, NCCL), as
``mlx_lm.server`` does: an object goes from rank 0 to the others as pickled
bytes summed into zeros (``all_sum``), which every backend implements. No
sockets of our own.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger("semantic.distributed")

# Set by ``mlx.launch`` (and by hand, to run ranks without it): a process with none of these is alone.
LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "MLX_JACCL_COORDINATOR")


class PeerLostError(RuntimeError):
    """Another rank stopped answering: it died, or its host or link went away."""


@dataclass(frozen=True)
class World:
    """This process's place among the ranks that share one model."""

    group: Any  # mx.distributed.Group
    rank: int
    size: int

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def label(self) -> str:
        return f"rank {self.rank} of {self.size}"

    def peers_described(self) -> str:
        """Who this rank talks to: a dead one of them is what a lost connection means."""
        others = sorted({(self.rank - 1) % self.size, (self.rank + 1) % self.size} - {self.rank})
        if len(others) == 1:
            return f"rank {others[0]}"
        return " or ".join(f"rank {r}" for r in others) + " (its neighbours in the ring)"

    # -- collectives (any thread; every rank must call them in the same order) -------------------
    def share(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (the others' is ignored)."""
        payload = pickle.dumps(obj) if self.is_root else b""
        size = int(self._sum(np.array([len(payload)], dtype=np.int64))[0])
        if size == 0:
            raise PeerLostError("rank 0 sent an empty message")
        data = np.frombuffer(payload, dtype=np.uint8) if self.is_root else np.zeros(size, dtype=np.uint8)
        return self._unpickle(self._sum(data).tobytes())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        payload = pickle.dumps(obj)
        sizes = np.zeros(self.size, dtype=np.int64)
        sizes[self.rank] = len(payload)
        sizes = self._sum(sizes)
        data = np.zeros(int(sizes.sum()), dtype=np.uint8)
        start = int(sizes[: self.rank].sum())
        data[start:start + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        data = self._sum(data)
        out, offset = [], 0
        for n in sizes.tolist():
            out.append(self._unpickle(data[offset:offset + n].tobytes()))
            offset += n
        return out

    def _unpickle(self, payload: bytes) -> Any:
        # A peer that dies during a collective can leave this rank's sum short of its bytes without an
        # error from MLX (its pending transfers are failed, the buffer keeps zeros): a torn message.
        try:
            return pickle.loads(payload)
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
            raise PeerLostError(f"{self.label}: lost the connection to {self.peers_described()} "
                                f"(a message arrived torn: {type(exc).__name__}: {exc})") from exc

    def barrier(self) -> None:
        self._sum(np.zeros(1, dtype=np.int64))

    def explain(self, exc: BaseException) -> BaseException:
        """An error from inside a step, as what it means under lockstep."""
        text = str(exc)
        if isinstance(exc, PeerLostError) or not isinstance(exc, RuntimeError):
            return exc
        if "[ring]" in text or "peer" in text.lower():
            return PeerLostError(f"{self.label}: lost the connection to {self.peers_described()} during a step ({exc})")
        return exc

    def _sum(self, values: np.ndarray) -> np.ndarray:
        try:
            summed = mx.distributed.all_sum(mx.array(values), group=self.group, stream=mx.cpu)
            return np.array(summed)
        except RuntimeError as exc:
            raise PeerLostError(f"{self.label}: lost the connection to {self.peers_described()} ({exc})") from exc


def launched_distributed() -> bool:
    """Whether a launcher (``mlx.launch``, mpirun) started this process as one of several ranks."""
    return any(os.environ.get(name) for name in LAUNCH_ENV)


@functools.cache
def join_world(backend: str = "any") -> World | None:
    """Join the ranks this process was launched with (once per process); None when it runs alone.

    ``strict`` initialisation makes a broken launch (a hostfile naming an
    unreachable host) an error here, not a silent world of one.
    """
    if not launched_distributed():
        return None
    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() == 1:
        return None
    world = World(group, group.rank(), group.size())
    log.info("joined %s (%s backend)", world.label, backend, extra={"rank": world.rank, "world_size": world.size})
    return world
