"""Turns through one mlx-lm BatchGenerator: admission, stepping, finishing.

Engine-thread only. Each public method is one named step of the engine loop;
state lives in ``Turn`` objects, not in loop locals.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

from engine.errors import PoolExhaustedError
from engine.models.loaded import LoadedModel

from .agent_table import AgentTable
from .agents import AgentRecord, AgentState, Tier
from .event_log import EventKind, EventLog
from .hot_cache import HotCache, ReusePlan
from .meters import RateMeter, RecentValues
from .requests import EngineEvent, EventSink, FinishReason, PrefillEvent, QueuedEvent, TokenEvent
from .sampling import build_sampler
from .shared_prefill import awaits_leader, segments, share_point, supports_early_sharing
from .text_stream import TextDelta, TextStream
from .tiers import HotState, TierManager
from .turn import Turn, TurnPhase


@dataclass(frozen=True, slots=True)
class RunnerLimits:
    max_batch_size: int
    prefill_batch_size: int
    prefill_step_size: int


GeneratorFactory = Callable[[LoadedModel, RunnerLimits], Any]


def mlx_generator_factory(loaded: LoadedModel, limits: RunnerLimits) -> Any:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(
        loaded.model,
        stop_tokens=[[t] for t in loaded.eos_token_ids],
        completion_batch_size=limits.max_batch_size,
        prefill_batch_size=limits.prefill_batch_size,
        prefill_step_size=limits.prefill_step_size,
        # The engine thread's own default stream: mlx-lm's module-level
        # thread-local stream, shared with other threads, aborts at exit.
        stream=mx.default_stream(mx.default_device()),
    )


class Admission(enum.Enum):
    ADMITTED = "admitted"
    LATER = "later"  # no room now; someone running will free blocks
    DEFERRED = "deferred"  # this turn's cache is still being read; try the next turn
    FAILED = "failed"


@dataclass(slots=True)
class RunnerStats:
    decode: RateMeter
    prefill: RateMeter
    ttft: RecentValues
    reused_total: int = 0
    requests_total: int = 0
    cache_hits: int = 0
    cache_misses: int = 0

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
        generator_factory: GeneratorFactory = mlx_generator_factory,
        prefix_sharing: bool = True,
    ) -> None:
        self.loaded = loaded
        self.hot = hot
        self.agents = agents
        self.tiers = tiers
        self.events = events
        self.limits = limits
        self._factory = generator_factory
        self.prefix_sharing = prefix_sharing
        self._generator = generator_factory(loaded, limits)
        self.waiting: deque[Turn] = deque()
        self.by_uid: dict[int, Turn] = {}
        self.by_request: dict[str, Turn] = {}
        self.stats = RunnerStats.new()
        self.watchers: dict[str, list[EventSink]] = {}
        self.early_sharing = prefix_sharing and supports_early_sharing(hot.spec)

    # -- observers -----------------------------------------------------------------
    def watch(self, agent_id: str, sink: EventSink) -> None:
        """Also send every event of ``agent_id``'s turns to ``sink`` (the workbench's live view)."""
        self.watchers.setdefault(agent_id, []).append(sink)

    def unwatch(self, agent_id: str, sink: EventSink) -> None:
        sinks = self.watchers.get(agent_id, [])
        if sink in sinks:
            sinks.remove(sink)

    def _emit(self, turn: Turn, event: EngineEvent) -> None:
        turn.sink(event)
        for watcher in self.watchers.get(turn.request.agent_id, ()):
            watcher(event)

    # -- queries -------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.by_uid)

    @property
    def batch_size(self) -> int:
        return len(self.by_uid)

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
            self._complete(turn, reason, None, None)
        else:
            turn.cancel_reason = reason
        return True

    # -- admission ---------------------------------------------------------------------
    def admit(self) -> None:
        """Move waiting turns into the batch while it has room, oldest first.

        A turn whose agent is still being read from disk is skipped, not
        waited for: the turns behind it go ahead.
        """
        # One turn per agent at a time: a second turn must see the first's cache.
        running = {t.request.agent_id for t in self.by_uid.values()}
        for turn in list(self.waiting):
            if len(self.by_uid) >= self.limits.max_batch_size:
                return
            if turn.request.agent_id in running:
                continue
            if self.early_sharing and awaits_leader(turn, self.agents.get(turn.request.agent_id),
                                                    self.by_uid.values(), self.hot.spec.block_tokens):
                continue
            outcome = self._admit(turn)
            if outcome is Admission.LATER:
                return
            if outcome is Admission.DEFERRED:
                continue
            self.waiting.remove(turn)
            running.add(turn.request.agent_id)

    def _admit(self, turn: Turn) -> Admission:
        request = turn.request
        agent = self.agents.for_request(request)
        if agent.turns == 0 and agent.tier in (Tier.EMPTY, Tier.COLD):
            agent.auxiliary = request.auxiliary
        self.agents.touch(agent)
        state = self.tiers.ensure_hot(agent, protect={t.request.agent_id for t in self.by_uid.values()})
        if state is HotState.PENDING:
            return Admission.DEFERRED
        if state is HotState.NO_ROOM:
            return self._no_room(turn)
        plan, absorb = self._plan(agent, turn)
        if absorb:
            self._take_plan(agent, plan)
            if not self._reserve(turn, agent):
                return self._no_room(turn)
        turn.plan, turn.absorb, turn.agent = plan, absorb, agent
        self._insert(turn, agent)
        return Admission.ADMITTED

    def _plan(self, agent: AgentRecord, turn: Turn) -> tuple[ReusePlan, bool]:
        donors = self.agents.get if self.prefix_sharing else None
        plan = self.hot.plan_reuse(agent, turn.request.prompt_tokens, donors)
        would_change = agent.tier is Tier.HOT and (plan.reused < len(agent.tokens) or plan.donor is not None)
        if turn.request.auxiliary and would_change and not agent.auxiliary:
            # Serve from the prefix without touching the main conversation's cache.
            note = "auxiliary request: the agent's cache was left intact"
            return replace(plan, note=note), False
        return plan, True

    def _take_plan(self, agent: AgentRecord, plan: ReusePlan) -> None:
        """Make the agent's hot cache exactly the plan's prefix before prefill."""
        donor = self.agents.get(plan.donor) if plan.donor else None
        if donor is not None:
            self.hot.adopt(agent, plan, donor)
            self.events.emit(
                EventKind.SHARE, f"{agent.agent_id}: shares {plan.reused} prefix tokens of {donor.agent_id}", agent.agent_id
            )
        else:
            # Positions past the divergence are useless to this turn; freeing
            # them first can spare another agent an eviction.
            self.hot.apply_trim(agent, plan.reused)

    def _reserve(self, turn: Turn, agent: AgentRecord) -> bool:
        need = self.hot.blocks_needed(agent, turn.prompt_len + 1)
        if self.hot.reserve(agent.agent_id, turn.reservation, need):
            return True
        protect = {agent.agent_id} | {t.request.agent_id for t in self.by_uid.values()}
        self.tiers.make_room(_missing(need, turn), protect, auxiliary_only=turn.request.auxiliary)
        return self.hot.reserve(agent.agent_id, turn.reservation, need)

    def _no_room(self, turn: Turn) -> Admission:
        if self.by_uid:
            return Admission.LATER  # a running sequence will finish and free blocks
        self.hot.release_reservation(turn.request.agent_id, turn.reservation)
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
        self._complete(turn, FinishReason.ERROR, None, None, error=message, error_type="rate_limit",
                       retry_after_s=PoolExhaustedError(message).retry_after_s)
        return Admission.FAILED

    def _insert(self, turn: Turn, agent: AgentRecord) -> None:
        request = turn.request
        k = turn.reused
        cache = self.hot.build_cache(self.loaded.model, turn.plan.runs) if k else None
        if self.early_sharing and turn.absorb:
            turn.share_at = share_point(turn, self.hot.spec.block_tokens)
        (uid,) = self._generator.insert_segments(
            [segments(turn)],
            max_tokens=[request.max_tokens],
            caches=[cache],
            all_tokens=[list(request.prompt_tokens[:k])],
            samplers=[build_sampler(request.sampling)],
        )
        turn.uid, turn.phase, turn.admitted_at = uid, TurnPhase.PREFILLING, time.monotonic()
        turn.text = TextStream(self.loaded.tokenizer.detokenizer, request.stop_strings)
        self.by_uid[uid] = turn
        agent.active_requests += 1
        agent.state = AgentState.PREFILLING
        agent.prefill_done, agent.prefill_total = 0, turn.to_prefill
        self._count_reuse(turn)
        self._emit(turn, PrefillEvent(turn.request_id, 0, turn.to_prefill, k))
        self.events.emit(
            EventKind.ADMIT,
            f"{agent.agent_id}: admitted, {k} tokens reused ({turn.plan.source}), {turn.to_prefill} to prefill",
            agent.agent_id,
        )

    def _count_reuse(self, turn: Turn) -> None:
        self.stats.requests_total += 1
        self.stats.reused_total += turn.reused
        if turn.reused:
            self.stats.cache_hits += 1
        else:
            self.stats.cache_misses += 1

    # -- stepping -----------------------------------------------------------------------
    def step(self) -> None:
        """One BatchGenerator step: a prefill chunk and/or one decoded token per sequence."""
        self._remove_cancelled()
        if not self.by_uid:
            return
        prompt_responses, generation_responses = self._generator.next()
        for response in prompt_responses:
            self._on_prefill(response)
        removals: list[tuple[Turn, FinishReason, str | None]] = []
        for response in generation_responses:
            removal = self._on_token(response)
            if removal is not None:
                removals.append(removal)
        if removals:
            self._remove(removals)

    def _on_prefill(self, response: Any) -> None:
        turn = self.by_uid.get(response.uid)
        if turn is None:
            return
        done, total = response.progress
        self.stats.prefill.add(done - turn.prefill_done)
        turn.prefill_done = done
        if turn.agent is not None:
            turn.agent.prefill_done = done
        if turn.share_at and response.end_of_segment and not turn.shared_early:
            self._share_early(turn)
        self._emit(turn, PrefillEvent(turn.request_id, done, total, turn.reused))

    def _share_early(self, turn: Turn) -> None:
        """The prefill reached ``share_at``: put those blocks in the pool now, so waiting turns can share them."""
        turn.shared_early = True  # one try: on any mismatch the turn simply absorbs at its end
        agent = turn.agent
        assert agent is not None
        cache, tokens = self._generator.extract_cache([turn.uid]).get(turn.uid, (None, None))
        if cache is None or list(tokens) != list(turn.request.prompt_tokens[:turn.share_at]):
            return
        try:
            self.hot.write_blocks(agent, cache, list(tokens), turn.reservation)
        except MemoryError:
            return
        agent.model_id = self.loaded.identity.key
        self.events.emit(EventKind.ADMIT, f"{agent.agent_id}: first {turn.share_at} prompt tokens shareable "
                         "before the turn ends", agent.agent_id)

    def _on_token(self, response: Any) -> tuple[Turn, FinishReason, str | None] | None:
        turn = self.by_uid.get(response.uid)
        if turn is None:
            return None
        self._mark_first_token(turn)
        turn.generated += 1
        self.stats.decode.add(1)
        delta = self._decode(turn, response)
        if response.finish_reason != "stop" or delta.text:
            self._emit(turn, TokenEvent(turn.request_id, response.token, delta.text))
        if delta.stop_sequence is not None:
            return turn, FinishReason.STOP_SEQUENCE, delta.stop_sequence
        if response.finish_reason is not None:
            reason = FinishReason.STOP if response.finish_reason == "stop" else FinishReason.LENGTH
            self._complete(turn, reason, response.prompt_cache, response.all_tokens)
            return None
        if turn.cancel_reason is not None:
            return turn, turn.cancel_reason, None
        if not self._grow(turn):
            return turn, FinishReason.CAPACITY, None
        return None

    def _mark_first_token(self, turn: Turn) -> None:
        if turn.first_token_at is not None:
            return
        turn.first_token_at = time.monotonic()
        turn.phase = TurnPhase.DECODING
        self.stats.prefill.add(turn.to_prefill - turn.prefill_done)
        turn.prefill_done = turn.to_prefill
        self.stats.ttft.add(turn.first_token_at - turn.submitted_at)
        if turn.agent is not None:
            turn.agent.state = AgentState.DECODING
            turn.agent.prefill_done = turn.to_prefill

    def _decode(self, turn: Turn, response: Any) -> TextDelta:
        assert turn.text is not None
        if response.finish_reason == "stop":
            return turn.text.finish()  # the end-of-sequence token itself is not text
        delta = turn.text.push(response.token)
        if response.finish_reason is not None and delta.stop_sequence is None:
            tail = turn.text.finish()
            return TextDelta(delta.text + tail.text, tail.stop_sequence)
        return delta

    def _grow(self, turn: Turn) -> bool:
        """Reserve the next block when the sequence is about to cross a block boundary."""
        if not turn.absorb or turn.cache_len % self.hot.spec.block_tokens != 0:
            return True
        agent = turn.agent
        assert agent is not None
        need = self.hot.blocks_needed(agent, turn.cache_len + 1)
        if self.hot.reserve(agent.agent_id, turn.reservation, need):
            return True
        protect = {t.request.agent_id for t in self.by_uid.values()}
        self.tiers.make_room(_missing(need, turn), protect, auxiliary_only=turn.request.auxiliary)
        return self.hot.reserve(agent.agent_id, turn.reservation, need)

    def _remove_cancelled(self) -> None:
        cancelled = [(t, t.cancel_reason, None) for t in self.by_uid.values() if t.cancel_reason is not None]
        if cancelled:
            self._remove(cancelled)  # type: ignore[arg-type]

    def _remove(self, removals: list[tuple[Turn, FinishReason, str | None]]) -> None:
        uids = [t.uid for t, _, _ in removals]
        caches = self._generator.remove(uids, return_prompt_caches=True)
        for turn, reason, stop_sequence in removals:
            cache, tokens = caches.get(turn.uid, (None, None))
            self._complete(turn, reason, cache, tokens, stop_sequence=stop_sequence)

    # -- completion ---------------------------------------------------------------------
    def _complete(self, turn: Turn, reason: FinishReason, cache: Any, tokens: list[int] | None, **extra: Any) -> None:
        turn.phase = TurnPhase.DONE
        self.by_request.pop(turn.request_id, None)
        if turn.uid is not None:
            self.by_uid.pop(turn.uid, None)
        agent = turn.agent or self.agents.get(turn.request.agent_id)
        if agent is not None:
            self._settle_agent(turn, agent, cache, tokens)
        event = turn.finish_event(reason, **extra)
        if agent is not None and turn.uid is not None:
            self._record_turn(agent, event.usage)
        self._emit(turn, event)
        self.events.emit(
            EventKind.FINISH if reason is not FinishReason.ERROR else EventKind.ERROR,
            f"{turn.request.agent_id}: {reason.value}, {turn.generated} tokens" + (f" ({extra['error']})" if "error" in extra else ""),
            turn.request.agent_id,
            logging.INFO if reason is not FinishReason.ERROR else logging.WARNING,
        )

    def _settle_agent(self, turn: Turn, agent: AgentRecord, cache: Any, tokens: list[int] | None) -> None:
        if turn.uid is not None:
            agent.active_requests = max(0, agent.active_requests - 1)
        if turn.absorb and cache is not None and tokens is not None:
            self._absorb(turn, agent, cache, tokens)
        else:
            self.hot.release_reservation(agent.agent_id, turn.reservation)
        if not agent.is_busy:
            agent.state = AgentState.QUEUED if self._has_waiting(agent.agent_id) else AgentState.IDLE

    def _absorb(self, turn: Turn, agent: AgentRecord, cache: Any, tokens: list[int]) -> None:
        try:
            self.hot.absorb(agent, cache, list(tokens), turn.reservation)
            agent.model_id = self.loaded.identity.key
        except MemoryError as exc:
            self.hot.release_reservation(agent.agent_id, turn.reservation)
            self.hot.drop(agent)
            agent.tier = Tier.COLD
            self.events.emit(EventKind.DISCARD, f"{agent.agent_id}: cache dropped ({exc})", agent.agent_id, logging.WARNING)

    def _record_turn(self, agent: AgentRecord, usage: Any) -> None:
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
        """The generator raised: finish every turn with an error and start a fresh generator."""
        message = f"{type(error).__name__}: {error}"
        for turn in list(self.by_uid.values()):
            turn.absorb = False
            self._complete(turn, FinishReason.ERROR, None, None, error=message, error_type="api_error")
        self._generator = self._factory(self.loaded, self.limits)

    def cancel_all(self, reason: FinishReason = FinishReason.CANCELLED) -> None:
        for turn in list(self.waiting):
            self.cancel(turn.request_id, reason)
        for turn in list(self.by_uid.values()):
            turn.cancel_reason = reason
        self._remove_cancelled()

    def close(self) -> None:
        """Release the generator on the engine thread.

        Its arrays belong to the thread's MLX stream; letting them be freed
        later from another thread (e.g. at interpreter exit) aborts the process.
        """
        close = getattr(self._generator, "close", None)
        if close is not None:
            close()
        self._generator = None


def _missing(need: dict[int, int], turn: Turn) -> int:
    """Free blocks the pool must have for ``turn``'s reservation to reach ``need``."""
    return sum(max(0, n - turn.reservation.count(g)) for g, n in need.items())
