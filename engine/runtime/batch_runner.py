"""Turns through one SequenceBatch: admission, stepping, finishing.

Engine-thread only. Each public method is one named step of the engine loop;
state lives in ``Turn`` objects, not in loop locals. Admission is in
``turn_admission.py``; the batch itself in ``batch/``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.errors import PoolExhaustedError
from engine.models.loaded import LoadedModel

from . import clock
from .agent_table import AgentTable
from .agents import AgentRecord, AgentState, Tier
from .batch.generator import CheckpointFn, PrefillProgress, RoomFn, SequenceBatch, TokenOut
from .batch.sequence import Finish, Sequence
from .event_log import EventKind, EventLog
from .hot_cache import HotCache
from .meters import RateMeter, RecentValues
from .repetition import RepetitionGuard
from .requests import EngineEvent, EventSink, FinishEvent, FinishReason, PrefillEvent, QueuedEvent, TokenEvent
from .sampling import build_sampler
from .shared_prefill import awaits_leader, share_point
from .text_stream import TextDelta, TextStream
from .tiers import TierManager
from .turn import Turn, TurnPhase
from .turn_admission import Admission, Admitter

log = logging.getLogger("semantic.engine")


@dataclass(frozen=True, slots=True)
class RunnerLimits:
    max_batch_size: int
    prefill_batch_size: int
    prefill_step_size: int


@dataclass(frozen=True, slots=True)
class BatchHooks:
    """What the batch asks of the engine while it runs: room to grow, and payment for checkpoints."""

    room: RoomFn
    checkpointed: CheckpointFn


GeneratorFactory = Callable[[LoadedModel, RunnerLimits, BatchHooks], Any]


def sequence_batch_factory(loaded: LoadedModel, limits: RunnerLimits, hooks: BatchHooks) -> SequenceBatch:
    return SequenceBatch(loaded.model, limits.prefill_step_size, limits.max_batch_size, hooks.room,
                         hooks.checkpointed)


@dataclass(slots=True)
class RunnerStats:
    decode: RateMeter
    prefill: RateMeter
    ttft: RecentValues
    reused_total: int = 0
    requests_total: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    # Hits split by where the reused tokens came from: the agent's own cache, or a prefix another
    # agent (or the disk's shared prefixes) held. They answer different questions.
    own_hits: int = 0
    shared_hits: int = 0
    reused_own: int = 0
    reused_shared: int = 0
    # Turns by how they met their agent's cache (forensics.CacheOutcome values).
    outcomes: Counter[str] = field(default_factory=Counter)

    @classmethod
    def new(cls) -> "RunnerStats":
        return cls(RateMeter(), RateMeter(), RecentValues())


class BatchRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        hot: HotCache,
        agents: AgentTable,
        tiers: TierManager,
        events: EventLog,
        limits: RunnerLimits,
        generator_factory: GeneratorFactory = sequence_batch_factory,
        prefix_sharing: bool = True,
        repetition_window: int = 0,
        queue_timeout_s: float | None = None,
        max_output_s: float = 0.0,
    ) -> None:
        self.loaded = loaded
        self.hot = hot
        self.agents = agents
        self.tiers = tiers
        self.events = events
        self.limits = limits
        self._factory = generator_factory
        self.prefix_sharing = prefix_sharing
        self.repetition_window = repetition_window
        self.queue_timeout_s = queue_timeout_s
        self.max_output_s = max_output_s
        self.admitter = Admitter(loaded, hot, agents, tiers, events, prefix_sharing)
        self._hooks = BatchHooks(self._room, self._checkpointed)
        self._generator = generator_factory(loaded, limits, self._hooks)
        self._uids = itertools.count()
        self._eos = frozenset(loaded.eos_token_ids)
        self.waiting: deque[Turn] = deque()
        self.by_uid: dict[int, Turn] = {}
        self.by_request: dict[str, Turn] = {}
        self.stats = RunnerStats.new()
        self.completed = 0  # turns finished so far, so the engine can publish right after one ends
        self.watchers: dict[str, list[EventSink]] = {}

    # -- observers -----------------------------------------------------------------
    def watch(self, agent_id: str, sink: EventSink) -> None:
        """Also send every event of ``agent_id``'s turns to ``sink`` (the workbench's live view)."""
        self.watchers.setdefault(agent_id, []).append(sink)

    def unwatch(self, agent_id: str, sink: EventSink) -> None:
        sinks = self.watchers.get(agent_id, [])
        if sink in sinks:
            sinks.remove(sink)

    def _emit(self, turn: Turn, event: EngineEvent) -> None:
        """Deliver an event; a sink that raises is detached (and its turn cancelled), nobody else is touched."""
        try:
            turn.sink(event)
        except Exception:
            log.exception("event sink of %s failed; detaching it", turn.request_id)
            turn.sink = _discard
            if turn.phase is not TurnPhase.DONE:
                turn.cancel_reason = FinishReason.CANCELLED
        for watcher in list(self.watchers.get(turn.request.agent_id, ())):
            try:
                watcher(event)
            except Exception:
                log.exception("a watcher of %s failed; detaching it", turn.request.agent_id)
                self.unwatch(turn.request.agent_id, watcher)

    # -- queries -------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.by_uid)

    @property
    def batch_size(self) -> int:
        return len(self.by_uid)

    def _running_agents(self) -> set[str]:
        return {t.request.agent_id for t in self.by_uid.values()}

    # -- submission and cancellation ---------------------------------------------------
    def submit(self, turn: Turn) -> None:
        self.waiting.append(turn)
        self.by_request[turn.request_id] = turn
        agent = self.agents.for_request(turn.request)
        if not agent.is_busy:
            agent.state = AgentState.QUEUED
        self.tiers.prefetch(agent)
        self._emit(turn, QueuedEvent(turn.request_id, len(self.waiting)))

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        turn = self.by_request.get(request_id)
        if turn is None:
            return False
        if turn.phase is TurnPhase.WAITING:
            self.waiting.remove(turn)
            self._complete(turn, reason)
        else:
            turn.cancel_reason = reason
        return True

    # -- admission ---------------------------------------------------------------------
    def admit(self) -> None:
        """Move waiting turns into the batch while it has room, oldest first.

        A turn whose agent is still being read from disk is skipped, not
        waited for: the turns behind it go ahead.
        """
        self._expire_waiting()
        # One turn per agent at a time: a second turn must see the first's cache.
        running = self._running_agents()
        for turn in list(self.waiting):
            if len(self.by_uid) >= self.limits.max_batch_size:
                return
            if turn.request.agent_id in running:
                continue
            if self.prefix_sharing and awaits_leader(turn, self.agents.get(turn.request.agent_id),
                                                     self.by_uid.values(), self.hot.spec.block_tokens):
                continue
            try:
                outcome = self.admitter.admit(turn, running)
            except Exception as exc:  # one turn that cannot be admitted must not stop the others
                self.waiting.remove(turn)
                self._fail_admission(turn, exc)
                continue
            if outcome is Admission.NO_ROOM:
                if self.by_uid:
                    return  # a running sequence will finish and free blocks
                self.waiting.remove(turn)
                self._no_room(turn)
                continue
            if outcome is Admission.DEFERRED:
                continue
            self.waiting.remove(turn)
            self._insert(turn)
            running.add(turn.request.agent_id)

    def _expire_waiting(self) -> None:
        """Turns that waited longer than the queue timeout are refused (overloaded), not served late."""
        if self.queue_timeout_s is None:
            return
        now = clock.now()
        for turn in [t for t in self.waiting if now - t.submitted_at > self.queue_timeout_s]:
            self.waiting.remove(turn)
            self._complete(turn, FinishReason.ERROR, error_type="overloaded", retry_after_s=5,
                           error=f"waited {now - turn.submitted_at:.0f} s for a free slot "
                                 f"(request_timeout_s {self.queue_timeout_s:g}); the server is overloaded")

    def _fail_admission(self, turn: Turn, error: Exception) -> None:
        """Admission raised: end that turn alone with an error, and drop whatever cache it half prepared."""
        log.exception("admitting %s failed", turn.request_id)
        holder, agent = turn.holder, turn.agent
        if holder is not None and holder is not agent:
            self.hot.release(holder)
        elif agent is not None and agent.kv is not None and agent.tier is Tier.HOT:
            self.hot.drop(agent)  # its cache may be half cut: recompute rather than serve it
            agent.tier = Tier.COLD
        self._complete(turn, FinishReason.ERROR, error=f"admission failed: {type(error).__name__}: {error}",
                       error_type="api_error")

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
        self._complete(turn, FinishReason.ERROR, error=message, error_type="rate_limit",
                       retry_after_s=PoolExhaustedError(message).retry_after_s)

    def _insert(self, turn: Turn) -> None:
        request, agent = turn.request, turn.agent
        assert agent is not None and turn.holder is not None and turn.holder.kv is not None
        k = turn.reused
        if self.prefix_sharing and turn.on_own_cache:
            turn.share_at = share_point(turn, self.hot.spec.block_tokens)
        uid = next(self._uids)
        turn.sequence = Sequence(
            uid, turn.holder.kv, list(request.prompt_tokens[k:]), request.max_tokens,
            sampler=build_sampler(request.sampling),
            stop_tokens=self._eos,
            checkpoint_at=tuple(sorted({turn.share_at, self._prefix_point(turn)} - {0})),
            checkpoint_prompt_end=turn.on_own_cache,
        )
        self._generator.insert(turn.sequence)
        turn.uid, turn.phase, turn.admitted_at = uid, TurnPhase.PREFILLING, time.monotonic()
        turn.text = TextStream(self.loaded.tokenizer.detokenizer, request.stop_strings,
                                request.turn_end_strings)
        turn.guard = RepetitionGuard(self.repetition_window)
        self.by_uid[uid] = turn
        agent.active_requests += 1
        agent.state = AgentState.PREFILLING
        agent.prefill_done, agent.prefill_total = 0, turn.to_prefill
        self._count_reuse(turn)
        self._emit(turn, PrefillEvent(turn.request_id, 0, turn.to_prefill, k))
        self.events.emit(
            EventKind.ADMIT,
            f"{agent.agent_id}: admitted, {k} tokens reused ({turn.plan.source if turn.plan else 'none'}), "
            f"{turn.to_prefill} to prefill",
            agent.agent_id,
        )

    def _prefix_point(self, turn: Turn) -> int:
        """Where the prompt's shareable prefix ends in whole blocks, if this turn computes it; else 0."""
        block = self.hot.spec.block_tokens
        point = min(turn.request.prefix_hint, turn.prompt_len - 1) // block * block
        if self.tiers.store is None or not turn.on_own_cache or point <= turn.reused:
            return 0
        return point

    def _store_prefix(self, turn: Turn, agent: AgentRecord) -> None:
        """The turn computed its prompt's shareable prefix: write it once for later agents."""
        store = self.tiers.store
        point = turn.request.prefix_hint // self.hot.spec.block_tokens * self.hot.spec.block_tokens
        if store is None or not store.usable or point == 0 or len(agent.tokens) < point or agent.kv is None:
            return
        if store.prefixes.has(agent.tokens[:point]):
            return
        slices = agent.kv.prefix_slices(point)
        if slices is not None:
            store.store_prefix(agent.tokens[:point], slices)

    def _count_reuse(self, turn: Turn) -> None:
        stats = self.stats
        stats.requests_total += 1
        stats.reused_total += turn.reused
        if turn.forensics is not None:
            stats.outcomes[turn.forensics.outcome.value] += 1
        if not turn.reused:
            stats.cache_misses += 1
            return
        stats.cache_hits += 1
        if turn.plan is not None and turn.plan.source == "self":
            stats.own_hits += 1
            stats.reused_own += turn.reused
        else:
            stats.shared_hits += 1
            stats.reused_shared += turn.reused

    # -- room while running ------------------------------------------------------------------
    def _room(self, sequence: Sequence, n_tokens: int) -> bool:
        """The batch needs ``n_tokens`` positions in a sequence's cache: reserve blocks, evicting if need be."""
        turn = self.by_uid.get(sequence.uid)
        if turn is None or turn.holder is None:
            return False
        if self.hot.ensure(turn.holder, n_tokens):
            return True
        missing = self.hot.missing_blocks(turn.holder, n_tokens)
        self.tiers.make_room(missing, self._running_agents(), auxiliary_only=turn.request.auxiliary)
        return self.hot.ensure(turn.holder, n_tokens)

    def _checkpointed(self, sequence: Sequence) -> None:
        """The batch took a checkpoint of a sequence's window layers: pay for it, or drop it."""
        turn = self.by_uid.get(sequence.uid)
        if turn is not None and turn.holder is not None:
            self.hot.settle(turn.holder)
            self.hot.keep_checkpoint(turn.holder)

    # -- stepping -----------------------------------------------------------------------
    def step(self) -> None:
        """One batch step: prefill chunks and/or one decoded token per sequence."""
        self._remove_cancelled()
        if not self.by_uid:
            return
        out = self._generator.step()
        for progress in out.prefill:
            self._on_prefill(progress)
        for uid in out.out_of_room:
            turn = self.by_uid.get(uid)
            if turn is not None:
                self._complete(turn, FinishReason.CAPACITY)
        for token in out.tokens:
            self._on_token(token)

    def _on_prefill(self, progress: PrefillProgress) -> None:
        turn = self.by_uid.get(progress.uid)
        if turn is None:
            return
        self.stats.prefill.add(progress.done - turn.prefill_done)
        turn.prefill_done = progress.done
        if turn.agent is not None:
            turn.agent.prefill_done = progress.done
        if turn.share_at and not turn.published and turn.reused + progress.done >= turn.share_at:
            self._publish_early(turn)
        self._emit(turn, PrefillEvent(turn.request_id, progress.done, progress.total + 1, turn.reused))

    def _publish_early(self, turn: Turn) -> None:
        """The prefill passed ``share_at``: offer the cache so far to waiting turns with the same prefix."""
        turn.published = True
        agent = turn.agent
        assert agent is not None and agent.kv is not None
        agent.tokens = list(turn.request.prompt_tokens[:agent.kv.offset])
        agent.model_id = self.loaded.identity.key
        self.hot.publish(agent)
        self.events.emit(EventKind.ADMIT, f"{agent.agent_id}: first {agent.kv.offset} prompt tokens shareable "
                         "before the turn ends", agent.agent_id)

    def _on_token(self, out: TokenOut) -> None:
        turn = self.by_uid.get(out.uid)
        if turn is None:
            return
        self._mark_first_token(turn)
        turn.generated += 1
        self.stats.decode.add(1)
        delta = self._decode(turn, out)
        if out.finish is not Finish.STOP or delta.text:
            self._emit(turn, TokenEvent(turn.request_id, out.token, delta.text))
        loop = turn.guard.push(out.token) if out.finish is None else None
        if delta.stop_sequence is not None:
            self._complete(turn, FinishReason.STOP_SEQUENCE, stop_sequence=delta.stop_sequence)
        elif delta.ends_turn:
            self._complete(turn, FinishReason.STOP)
        elif out.finish is not None:
            self._complete(turn, FinishReason.STOP if out.finish is Finish.STOP else FinishReason.LENGTH)
        elif turn.cancel_reason is not None:
            self._complete(turn, turn.cancel_reason)
        elif loop is not None:
            self._cut_loop(turn, loop.describe())
        elif self._out_of_time(turn):
            self._end_for_time(turn)

    def _cut_loop(self, turn: Turn, description: str) -> None:
        """A runaway repetition: end the turn with what it said so far, and say why."""
        self._end_early(turn, FinishReason.REPETITION, f"ended by the repetition guard: {description}")

    def _end_early(self, turn: Turn, reason: FinishReason, note: str) -> None:
        """The server, not the model or the request, ends the turn: keep what it said, log and report why."""
        self.events.emit(EventKind.FINISH, f"{turn.request.agent_id}: {note}", turn.request.agent_id, logging.WARNING)
        self._complete(turn, reason, note=note)

    def _out_of_time(self, turn: Turn) -> bool:
        started = turn.first_token_tick
        return self.max_output_s > 0 and started is not None and clock.now() - started >= self.max_output_s

    def _end_for_time(self, turn: Turn) -> None:
        """Generating past ``max_output_s``: end as max_tokens would, before the client's own timeout does."""
        self._end_early(turn, FinishReason.LENGTH, f"ended after {self.max_output_s:g} s of generating (max_output_seconds)")

    def _mark_first_token(self, turn: Turn) -> None:
        if turn.first_token_at is not None:
            return
        turn.first_token_at = time.monotonic()
        turn.first_token_tick = clock.now()
        turn.phase = TurnPhase.DECODING
        self.stats.prefill.add(turn.to_prefill - turn.prefill_done)
        turn.prefill_done = turn.to_prefill
        self.stats.ttft.add(turn.first_token_at - turn.submitted_at)
        if turn.agent is not None:
            turn.agent.state = AgentState.DECODING
            turn.agent.prefill_done = turn.to_prefill

    def _decode(self, turn: Turn, out: TokenOut) -> TextDelta:
        assert turn.text is not None
        if out.finish is Finish.STOP:
            return turn.text.finish()  # the end-of-sequence token itself is not text
        delta = turn.text.push(out.token)
        if out.finish is not None and delta.stop_sequence is None and not delta.ends_turn:
            tail = turn.text.finish()
            return TextDelta(delta.text + tail.text, tail.stop_sequence, tail.ends_turn)
        return delta

    def _remove_cancelled(self) -> None:
        for turn in [t for t in self.by_uid.values() if t.cancel_reason is not None]:
            self._complete(turn, turn.cancel_reason)  # type: ignore[arg-type]

    # -- completion ---------------------------------------------------------------------
    def _complete(self, turn: Turn, reason: FinishReason, **extra: Any) -> None:
        started = time.monotonic()
        self.completed += 1
        turn.phase = TurnPhase.DONE
        self.by_request.pop(turn.request_id, None)
        if turn.uid is not None:
            self.by_uid.pop(turn.uid, None)
            self._generator.remove(turn.uid)
        agent = turn.agent or self.agents.get(turn.request.agent_id)
        kv = turn.holder.kv if turn.holder is not None and turn.uid is not None else None
        if agent is not None:
            self._settle(turn, agent, failed=reason is FinishReason.ERROR and turn.uid is not None)
        if kv is not None:
            turn.copied_bytes += kv.copied - turn.copied_mark  # growth while running, and the tidy after
        turn.handoff_out_s = time.monotonic() - started
        event = turn.finish_event(reason, **extra)
        if agent is not None and turn.uid is not None:
            self._record_turn(agent, event)
            asked = turn.request.asked_max_tokens
            if reason is FinishReason.LENGTH and asked is not None and event.note is None:
                agent.last_finish_note = (f"max_tokens {asked} clamped to {turn.request.max_tokens} "
                                          "by the server's max_output_tokens")
        self._emit(turn, event)
        self.events.emit(
            EventKind.FINISH if reason is not FinishReason.ERROR else EventKind.ERROR,
            f"{turn.request.agent_id}: {reason.value}, {turn.generated} tokens" + (f" ({extra['error']})" if "error" in extra else ""),
            turn.request.agent_id,
            logging.INFO if reason is not FinishReason.ERROR else logging.WARNING,
        )

    def _settle(self, turn: Turn, agent: AgentRecord, failed: bool) -> None:
        """The turn is over: its cache now holds what was fed; account for it (or drop it)."""
        if turn.uid is not None:
            agent.active_requests = max(0, agent.active_requests - 1)
            if failed and turn.on_own_cache:
                # A step that raised may have updated some layers and not others.
                self.hot.drop(agent)
                agent.tier = Tier.COLD
            elif turn.on_own_cache and turn.sequence is not None:
                agent.tokens = list(turn.request.prompt_tokens[:turn.reused]) + turn.sequence.fed
                agent.turn_ends = [end for end in agent.turn_ends if end <= turn.reused] + [len(agent.tokens)]
                self.hot.tidy(agent)
                self.hot.publish(agent)
                agent.model_id = self.loaded.identity.key
                self._store_prefix(turn, agent)
            elif turn.holder is not None:
                self.hot.release(turn.holder)  # a side request's private cache
        if not agent.is_busy:
            agent.state = AgentState.QUEUED if self._has_waiting(agent.agent_id) else AgentState.IDLE

    def _record_turn(self, agent: AgentRecord, event: FinishEvent) -> None:
        usage = event.usage
        agent.last_finish, agent.last_finish_note = event.reason.value, event.note or event.error
        agent.turns += 1
        agent.prompt_tokens_total += usage.prompt_tokens
        agent.reused_tokens_total += usage.reused_tokens
        agent.generated_tokens_total += usage.generated_tokens
        agent.last_ttft_s = usage.ttft_s
        agent.last_decode_tok_s = usage.decode_tok_s
        agent.prefill_done = agent.prefill_total = 0

    def _has_waiting(self, agent_id: str) -> bool:
        return any(t.request.agent_id == agent_id for t in self.waiting)

    # -- failure ------------------------------------------------------------------------
    def fail_all(self, error: BaseException) -> None:
        """The batch raised: finish every running turn with an error and start a fresh batch."""
        message = f"{type(error).__name__}: {error}"
        for turn in list(self.by_uid.values()):
            self._complete(turn, FinishReason.ERROR, error=message, error_type="api_error")
        self._generator = self._factory(self.loaded, self.limits, self._hooks)

    def cancel_all(self, reason: FinishReason = FinishReason.CANCELLED) -> None:
        for turn in list(self.waiting):
            self.cancel(turn.request_id, reason)
        for turn in list(self.by_uid.values()):
            turn.cancel_reason = reason
        self._remove_cancelled()

    def close(self) -> None:
        """Release the batch on the engine thread (its arrays belong to this thread's stream)."""
        self._generator = None


def _discard(event: EngineEvent) -> None:
    """The sink of a turn whose own sink failed: nobody is listening any more."""
