"""The engine's side of lockstep (engine/distributed/lockstep.py), kept out of the engine loop.

What a rank agrees on with the others at start (settings, which warm caches
every rank holds whole), what rank 0 records for the others while it runs its
commands, what every rank applies from each tick, and the digest each step
leaves for the next tick's comparison.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterable

from engine.distributed.lockstep import Lockstep, OpKind, ReplicatedOp
from engine.domain.event_log import EventKind, EventLog
from engine.domain.requests import AgentSource, GenerationRequest
from engine.runtime import clock
from engine.runtime.scheduler.turn import Turn
from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.runtime.tiers.startup_index import index_agents
from engine.settings import EngineSettings

if TYPE_CHECKING:
    from engine.runtime.scheduler.scheduler import Scheduler
    from engine.store.warm_store import WarmStore

log = logging.getLogger("semantic.engine")

# An idle server's pause between ticks (lockstep.py): none for the first IDLE_AFTER_S without work (an agent's
# next turn often comes at once), then a tenth of the time idle, up to MAX_PAUSE_S: what a first request after
# a long idle waits at most for the other ranks to wake.
IDLE_AFTER_S = 0.2
MAX_PAUSE_S = 0.25


class Replica:
    """This rank's side of lockstep (ranks.Ranks): rank 0 records its inputs, every rank ticks."""

    alone = False

    def __init__(self, lockstep: Lockstep, agents: AgentTable, events: EventLog,
                 apply: Callable[[Any], Any]) -> None:
        self.lockstep = lockstep
        self.agents = agents
        self.events = events
        self.apply = apply  # runs an EngineOp on this rank's engine (what rank 0 called on its own)
        self.digest: tuple[Any, ...] = ()  # this rank's state after its last step
        self.pause_s = 0.0  # the last tick's pause: how long to wait before the next one
        self._idle_since: float | None = None  # rank 0: since when nothing was queued or running

    @property
    def is_root(self) -> bool:
        return self.lockstep.is_root

    @property
    def reports(self) -> tuple[Any, ...]:
        return self.lockstep.reports

    def explain(self, exc: BaseException) -> BaseException:
        return self.lockstep.world.explain(exc)  # type: ignore[arg-type]

    # -- start-up -------------------------------------------------------------------------------
    def agree_on_settings(self, model_key: str, pool_blocks: int, block_bytes: int, settings: EngineSettings,
                          sampling: str) -> None:
        """Every rank must decide alike: same model, pool size and engine settings (timings aside)."""
        settings = replace(settings, batch=replace(settings.batch, batch_window_ms=0),
                           turns=replace(settings.turns, watchdog_s=0))
        self.lockstep.agree("the engine's settings", (model_key, pool_blocks, block_bytes, repr(settings), sampling))

    def index_store(self, agents: AgentTable, store: "WarmStore | None", seeds: Iterable[Any],
                    events: EventLog) -> None:
        """The warm agents every rank holds whole (the others go cold everywhere), and rank 0's cold list (both
        read only where there is a store)."""
        index_agents(agents, store, seeds, events, lambda headers: self.whole_shards(store, headers), self.rank0s)

    def whole_shards(self, store: "WarmStore", headers: list[Any]) -> list[Any]:
        """The warm agents every rank holds a matching shard of; the others go cold on every rank."""
        local = {h.agent_id: (h.n_tokens, store.entries[h.agent_id].token_hash) for h in headers}
        keep = self.lockstep.common(local)
        every = sorted(set().union(*self.lockstep.world.gather(sorted(local))))
        for agent_id in (a for a in every if a not in keep):
            store.forget(agent_id)
            self.agents.add(AgentRecord(agent_id, AgentSource.API, None)).move_to(Tier.COLD)
            self.events.emit(EventKind.DISCARD, f"{agent_id}: its warm cache is missing or different on "
                                    "another rank; cold on every rank (its conversation is prefilled again)",
                                    agent_id, logging.WARNING)
        shared = self.lockstep.common({key: entry.n_tokens for key, entry in store.prefixes.entries.items()})
        for key in set(store.prefixes.entries) - shared:
            store.prefixes.forget(key)
        return [h for h in headers if h.agent_id in keep]

    def rank0s(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (the cold agents' list: the agent tables must match)."""
        return self.lockstep.share(value)

    # -- running ----------------------------------------------------------------------------------
    def seeded(self, request: GenerationRequest) -> GenerationRequest:
        """Every rank samples a turn with the same key: rank 0 picks the seed a request left open."""
        if request.sampling.seed is not None or request.sampling.is_greedy:
            return request
        seed = int.from_bytes(os.urandom(8), "little")
        return replace(request, sampling=replace(request.sampling, seed=seed))

    def record(self, kind: str, *args: Any) -> None:
        """Rank 0: an input the other ranks apply at the same point of their loop."""
        self.lockstep.record(OpKind(kind), *args)

    def tick(self, scheduler: "Scheduler", stop: bool) -> bool:
        """Exchange this pass's tick; the other ranks apply rank 0's inputs. True: the run ends now."""
        now = time.monotonic()
        tick = self.lockstep.exchange(now, stop, self.digest, self._pause(scheduler, now, stop))
        self.pause_s = tick.pause_s
        clock.set_tick(tick.now)
        if not self.is_root:
            for op in tick.ops:
                self._replay(op, scheduler)
        return tick.stop

    def _pause(self, scheduler: "Scheduler", now: float, stop: bool) -> float:
        """Rank 0: the pause to announce (the others ignore theirs); none while there is work or on the way out."""
        if stop or scheduler.has_work:
            self._idle_since = None
            return 0.0
        if self._idle_since is None:
            self._idle_since = now
        idle = now - self._idle_since
        return 0.0 if idle < IDLE_AFTER_S else min(MAX_PAUSE_S, idle / 10)

    def after_step(self, scheduler: "Scheduler", used_blocks: int) -> None:
        """What every rank must agree on after each step (compared at the next tick)."""
        running = tuple((uid, turn.generated) for uid, turn in sorted(scheduler.queues.by_uid.items()))
        self.digest = (used_blocks, len(scheduler.waiting), scheduler.completed, running)

    def _replay(self, op: ReplicatedOp, scheduler: "Scheduler") -> None:
        if op.kind is OpKind.SUBMIT:
            request, submitted_at = op.args
            scheduler.submit(Turn(request, _discard, submitted_at=submitted_at))
        elif op.kind is OpKind.CANCEL:
            scheduler.cancel(*op.args)
        elif op.kind is OpKind.CANCEL_ALL:
            scheduler.cancel_all(*op.args)
        else:
            (call,) = op.args
            try:
                self.apply(call)
            except Exception as exc:  # rank 0 met the same error and answered its caller with it
                log.debug("replayed %s failed as on rank 0: %s", call.name, exc)


def _discard(event: Any) -> None:
    """The sink of a replayed turn: its client talks to rank 0."""
