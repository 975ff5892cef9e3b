"""Admission: which waiting turns enter the batch, in what order, and what happens to those that cannot.

Most urgent first (``priorities.py``: priority level, then arrival), one
turn per agent at a time (a second turn must see the first's cache), while
the batch has room. A turn whose cache is still being
read from disk, or that waits for a leader about to share its prefix
(``shared_prefill.py``), is passed over, not waited for: the turns behind it
go ahead. Preparing a turn's cache is ``turn_cache.py``'s.
"""

from __future__ import annotations

import itertools
import logging
import time

from engine.domain.event_log import EventKind
from engine.domain.requests import FinishReason, PrefillEvent
from engine.errors import PoolExhaustedError
from engine.runtime import clock
from engine.runtime.runner.sequence import Sequence
from engine.runtime.scheduler.completion import Completion
from engine.runtime.scheduler.parts import SchedulerPart, SchedulerState
from engine.runtime.scheduler.priorities import Priorities
from engine.runtime.scheduler.shared_prefill import awaits_leader, share_point
from engine.runtime.scheduler.turn import Turn
from engine.runtime.scheduler.turn_cache import Readiness, TurnCaches
from engine.runtime.scheduler.turn_start import TurnStart
from engine.runtime.tiers.agents import Tier
from engine.settings import BatchSettings, TurnSettings

log = logging.getLogger("semantic.engine")


class Admission(SchedulerPart):
    def __init__(self, state: SchedulerState, completion: Completion, caches: TurnCaches, start: TurnStart,
                 batch: BatchSettings, turns: TurnSettings, priorities: Priorities) -> None:
        super().__init__(state)
        self.priorities = priorities
        self.completion = completion
        self.caches = caches
        self.start = start
        self.batch = batch
        self.turns = turns
        self.prefix_sharing = caches.prefix_sharing
        self._uids = itertools.count()
        # Under memory pressure (runtime/memory_pressure.py): the most pool blocks new turns may bring the pool
        # to, making room by sending idle caches away; None: no limit but the pool's own.
        self.ceiling: int | None = None

    def admit(self, within_s: float | None = None) -> list[Sequence]:
        """Move waiting turns into the batch while it has room, most urgent first (priorities.py): their
        sequences, for the batch. A paused agent's turn waits. ``within_s``: stop once admitting has taken that
        long (the rest wait for the next pass)."""
        started = time.perf_counter()
        self._expire_waiting()
        queues = self.queues
        running = queues.running_agents()
        admitted: list[Sequence] = []
        for turn in self.priorities.in_order(queues.waiting):
            if len(queues.by_uid) >= self.batch.max_batch_size:
                break
            if within_s is not None and time.perf_counter() - started >= within_s:
                break
            if turn.request.agent_id in running or self.priorities.is_paused(turn):
                continue
            if self.prefix_sharing and awaits_leader(turn, self.agents.get(turn.request.agent_id),
                                                     queues.by_uid.values(), self.hot.spec.block_tokens):
                continue
            if queues.by_uid and not self._under_ceiling(turn, running):
                break  # memory is short: the running turns finish first
            try:
                readiness = self.caches.prepare(turn, running)
            except Exception as exc:  # one turn that cannot be admitted must not stop the others
                queues.waiting.remove(turn)
                self._fail(turn, exc)
                continue
            if readiness is Readiness.NO_ROOM:
                if queues.by_uid:
                    break  # a running sequence will finish and free blocks
                queues.waiting.remove(turn)
                self._no_room(turn)
                continue
            if readiness is Readiness.DEFERRED:
                continue
            queues.waiting.remove(turn)
            admitted.append(self._insert(turn))
            running.add(turn.request.agent_id)
        return admitted

    def _under_ceiling(self, turn: Turn, running: set[str]) -> bool:
        """Whether the turn fits under the memory ceiling, once idle caches have made room for it (the turn's
        own cache counts as held already)."""
        if self.ceiling is None:
            return True
        pool = self.hot.pool
        agent = self.agents.get(turn.request.agent_id)
        held = sum(len(ids) for ids in agent.blocks.values()) if agent is not None else 0
        need = max(0, self.hot.spec.total_blocks_for_tokens(len(turn.request.prompt_tokens) + 1) - held)
        if pool.used_blocks + need <= self.ceiling:
            return True
        protect = running | {turn.request.agent_id}
        self.tiers.make_room(pool.total_blocks - self.ceiling + need, protect, reason="memory pressure")
        return pool.used_blocks + need <= self.ceiling

    def _expire_waiting(self) -> None:
        """Turns that waited longer than ``request_timeout_s`` are refused (overloaded), not served late."""
        limit, now = self.turns.request_timeout_s, clock.now()
        for turn in [t for t in self.queues.waiting if now - t.submitted_at > limit]:
            self.queues.waiting.remove(turn)
            self.completion.complete(turn, FinishReason.ERROR, error_type="overloaded", retry_after_s=5,
                                     error=f"waited {now - turn.submitted_at:.0f} s for a free slot "
                                           f"(request_timeout_s {limit:g}); the server is overloaded")

    def _fail(self, turn: Turn, error: Exception) -> None:
        """Preparing the cache raised: end that turn alone with an error, and drop what it half prepared."""
        log.exception("admitting %s failed", turn.request_id)
        holder, agent = turn.holder, turn.agent
        if holder is not None and holder is not agent:
            self.hot.release(holder)
        elif agent is not None and agent.kv is not None and agent.tier is Tier.HOT:
            self.hot.drop(agent)  # its cache may be half cut: recompute rather than serve it
            agent.move_to(Tier.COLD)
        self.completion.complete(turn, FinishReason.ERROR, error_type="api_error",
                                 error=f"admission failed: {type(error).__name__}: {error}")

    def _no_room(self, turn: Turn) -> None:
        pool = self.hot.pool
        if turn.request.auxiliary:
            # A side request (title, classifier) may only evict other side agents, never a conversation.
            held = "held by agents' conversations, which a side request may not evict"
        else:
            held = "held by pinned or busy agents"
        message = (
            f"KV pool exhausted: {pool.used_blocks}/{pool.total_blocks} blocks {held}; "
            "evict or unpin agents, or raise the pool budget"
        )
        self.completion.complete(turn, FinishReason.ERROR, error=message, error_type="rate_limit",
                                 retry_after_s=PoolExhaustedError(message).retry_after_s)

    def _insert(self, turn: Turn) -> Sequence:
        """The turn's cache is ready: its sequence, to enter the batch."""
        request, agent = turn.request, turn.agent
        assert agent is not None
        k = turn.reused
        share_at = share_point(turn, self.hot.spec.block_tokens) if self.prefix_sharing and turn.on_own_cache else 0
        uid = next(self._uids)
        sequence = self.start.sequence(uid, turn, tuple(sorted({share_at, self._prefix_point(turn)} - {0})))
        turn.admit(uid, sequence, *self.start.readers(request), share_at)
        self.priorities.admitted(turn)
        self.queues.by_uid[uid] = turn
        agent.turn_started(turn.to_prefill)
        self.stats.count_reuse(turn)
        self.delivery.emit(turn, PrefillEvent(turn.request_id, 0, turn.to_prefill, k))
        self.events.emit(
            EventKind.ADMIT,
            f"{agent.agent_id}: admitted, {k} tokens reused ({turn.plan.source if turn.plan else 'none'}), "
            f"{turn.to_prefill} to prefill",
            agent.agent_id,
        )
        return turn.sequence

    def _prefix_point(self, turn: Turn) -> int:
        """Where the prompt's shareable prefix ends in whole blocks, if this turn computes it; else 0."""
        block = self.hot.spec.block_tokens
        point = min(turn.request.prefix_hint, turn.prompt_len - 1) // block * block
        if self.tiers.store is None or not turn.on_own_cache or point <= turn.reused:
            return 0
        return point
