"""Ranks as threads of one process: the lockstep engine's exchange without processes or sockets.

Each rank's ``share``/``gather`` meets the others at a barrier, and every
object is pickled across as ``mx.distributed`` would carry it. A rank that
stops answering breaks the barrier, which the others see as a lost peer.
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field
from typing import Any

from engine.distributed.world import PeerLostError, World


@dataclass
class ThreadHub:
    size: int
    timeout_s: float = 30.0
    slots: list[Any] = field(default_factory=list)
    barrier: threading.Barrier = field(init=False)

    def __post_init__(self) -> None:
        self.slots = [None] * self.size
        self.barrier = threading.Barrier(self.size, timeout=self.timeout_s)

    def worlds(self) -> list["ThreadWorld"]:
        return [ThreadWorld(None, rank, self.size, self) for rank in range(self.size)]

    def exchange(self, rank: int, payload: bytes) -> list[bytes]:
        try:
            self.slots[rank] = payload
            self.barrier.wait()
            everyone = list(self.slots)
            self.barrier.wait()
            return everyone
        except threading.BrokenBarrierError as exc:
            raise PeerLostError(f"rank {rank} of {self.size}: lost the connection to a peer") from exc


@dataclass(frozen=True)
class ThreadWorld(World):
    hub: ThreadHub | None = None

    def share(self, obj: Any = None) -> Any:
        assert self.hub is not None
        return pickle.loads(self.hub.exchange(self.rank, pickle.dumps(obj))[0])

    def gather(self, obj: Any) -> list[Any]:
        assert self.hub is not None
        return [pickle.loads(p) for p in self.hub.exchange(self.rank, pickle.dumps(obj))]

    def barrier(self) -> None:
        self.gather(None)
