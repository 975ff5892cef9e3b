"""The scheduler: turns through one batch of sequences, one named step of the engine loop at a time.

Engine-thread only. Its state is one :class:`TurnQueues`; each concern is a
file of its own: which waiting turns enter the batch (``admission.py``), how
an admitted turn's cache is prepared (``turn_cache.py``), room for a step
and payment for its checkpoints (``step_room.py``), what a step of the batch
means for its turns (``stepping.py``), how a turn ends (``completion.py``),
and who hears of it (``delivery.py``). The batch itself is the model
runner's (``runtime/runner/batch.py``).

One step (:meth:`Scheduler.step`) is plan, grant, run, apply: the batch says
what it will do and how much room that needs, the scheduler reserves the
room (evicting other agents when it must), the batch runs the model within
it, and the scheduler applies the output to its turns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from engine.domain.requests import EventSink, FinishReason, QueuedEvent
from engine.grammar.output_grammars import OutputGrammars
from engine.models.loaded import LoadedModel
from engine.runtime.runner.backends.protocol import Backend
from engine.runtime.runner.batch import SequenceBatch
from engine.runtime.runner.image_embeddings import ImageEmbedder
from engine.runtime.runner.sequence import Phase
from engine.runtime.runner.speculative_step import SpeculationSetup
from engine.runtime.runner.stepped_batch import SteppedBatch
from engine.runtime.scheduler.admission import Admission
from engine.runtime.scheduler.completion import Completion
from engine.runtime.scheduler.parts import SchedulerPart, SchedulerState
from engine.runtime.scheduler.prefill_pacer import PrefillPacer
from engine.runtime.scheduler.priorities import Priorities
from engine.runtime.scheduler.step_room import StepRoom
from engine.runtime.scheduler.stepping import Stepping
from engine.runtime.scheduler.turn import Turn, TurnPhase
from engine.runtime.scheduler.turn_cache import TurnCaches
from engine.runtime.scheduler.turn_start import TurnStart
from engine.settings import BatchSettings, EngineSettings

# An agent that started a turn this recently may send the next one any moment (a person reading the reply, a
# client between tool calls): a less urgent prompt's prefill is paced for it even when nothing decodes.
EXPECTED_BACK_S = 60.0


@dataclass(frozen=True, slots=True)
class BatchHooks:
    """What the batch gets from the engine: how to compute (the backend), and whether it may keep time."""

    backend: Backend
    # Whether the batch may decide by its own clock (how fast its steps run). Under lockstep every rank must
    # decide alike from the same inputs, so it may not.
    timed: bool = True


BatchFactory = Callable[[LoadedModel, BatchSettings, BatchHooks], SteppedBatch]


def sequence_batch_factory(loaded: LoadedModel, batch: BatchSettings, hooks: BatchHooks) -> SequenceBatch:
    draft = loaded.draft.model if loaded.draft is not None and batch.speculate == "draft" else None
    images = (ImageEmbedder(loaded.vision, loaded.model, batch.image_feature_cache, hooks.backend.vision_pass)
              if loaded.vision is not None else None)
    return SequenceBatch(loaded.model, batch.prefill_step_size, batch.max_batch_size,
                         keep_turn_checkpoints=turn_checkpoints(loaded, batch), backend=hooks.backend,
                         speculation=SpeculationSetup(batch.max_draft, hooks.timed, draft), images=images)


def turn_checkpoints(loaded: LoadedModel, batch: BatchSettings) -> int:
    """How many turn checkpoints an agent keeps: one (a window's ring copy is large and a ring goes back on its
    own); for recurrent state, which goes back only to a snapshot, as many as ``snapshot_budget_mb`` holds."""
    spec = loaded.spec
    if not spec.recurrent_groups:
        return 1
    return max(1, int(batch.snapshot_budget_mb * 2**20) // spec.state_bytes)


class Scheduler(SchedulerPart):
    def __init__(self, loaded: LoadedModel, state: SchedulerState, settings: EngineSettings, hooks: BatchHooks,
                 batch_factory: BatchFactory = sequence_batch_factory,
                 grammars: OutputGrammars | None = None) -> None:
        super().__init__(state)
        self.loaded = loaded
        self.batch_settings = batch = settings.batch
        turns = settings.turns
        self._factory = batch_factory
        self._hooks = hooks
        self.room = StepRoom(state)
        self._batch: SteppedBatch | None = batch_factory(loaded, batch, hooks)
        self.completion = Completion(state, loaded.identity.key, lambda uid: self._stepped().remove(uid))
        start = TurnStart(loaded.tokenizer, frozenset(loaded.eos_token_ids), turns.repetition_window, grammars,
                          loaded.reasoning)
        caches = TurnCaches(state, loaded, settings.cache.prefix_sharing)
        scheduling = settings.scheduling
        self.priorities = Priorities(state, scheduling.policy())
        self.pacer = PrefillPacer(scheduling.decode_gap_ms, hooks.timed)
        # Prompt tokens a step may prefill at most (the engine lowers it while another model waits).
        self._prefill_limit = batch.prefill_step_size
        self.admission = Admission(state, self.completion, caches, start, batch, turns, self.priorities)
        self.stepping = Stepping(state, self.completion, turns)

    # -- observers -----------------------------------------------------------------
    def watch(self, agent_id: str, sink: EventSink) -> None:
        """Also send every event of ``agent_id``'s turns to ``sink`` (the workbench's live view)."""
        self.delivery.watch(agent_id, sink)

    def unwatch(self, agent_id: str, sink: EventSink) -> None:
        self.delivery.unwatch(agent_id, sink)

    # -- queries -------------------------------------------------------------------
    @property
    def images(self) -> ImageEmbedder | None:
        """The batch's image embedder (a vision model's), for its meters; None for a text model."""
        return self._batch.images if self._batch is not None else None

    @property
    def waiting(self) -> Any:
        return self.queues.waiting

    @property
    def has_work(self) -> bool:
        return bool(self.queues.waiting or self.queues.by_uid)

    def limit_prefill(self, tokens: int) -> None:
        """Prompt tokens the next steps may prefill (the engine lowers it while another model waits for the
        device, engine_thread/device_turns.py)."""
        self._prefill_limit = tokens

    @property
    def batch_size(self) -> int:
        return len(self.queues.by_uid)

    @property
    def completed(self) -> int:
        return self.stats.completed

    # -- submission and cancellation ---------------------------------------------------
    def submit(self, turn: Turn) -> None:
        self.queues.waiting.append(turn)
        self.queues.by_request[turn.request_id] = turn
        agent = self.agents.for_request(turn.request)
        self.priorities.place(turn, agent)
        if not agent.is_busy:
            agent.queued()
        self.tiers.prefetch(agent)
        self.delivery.emit(turn, QueuedEvent(turn.request_id, len(self.queues.waiting)))

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        turn = self.queues.by_request.get(request_id)
        if turn is None:
            return False
        if turn.phase is TurnPhase.WAITING:
            self.queues.waiting.remove(turn)
            self.completion.complete(turn, reason)
        else:
            turn.cancel(reason)
        return True

    # -- the engine loop's steps ---------------------------------------------------------
    def admit(self) -> None:
        # With work running, admission (a prefix copied, a cache read back) takes at most about one paced step
        # before the batch steps again: a turn arriving meanwhile waits that long, not for every queued turn.
        within = self.pacer.gap_s if self.pacer.enabled and self.queues.by_uid else None
        for sequence in self.admission.admit(within):
            self._stepped().insert(sequence)

    def step(self) -> None:
        """One batch step: prefill chunks and/or one decoded token per sequence (more where it speculates)."""
        self._remove_cancelled()
        if not self.queues.by_uid:
            return
        batch = self._stepped()
        batch.prefill_step_size = self._prefill_budget()
        plan = batch.plan()  # what the step will do, and the room each cache needs for it
        room = self.room.grant(plan)  # reserved before the model runs; the only part that may evict
        decoding = batch.decoding
        started = time.perf_counter()
        out = batch.step(plan, room)  # model work only, within that room
        self.pacer.observe(time.perf_counter() - started, sum(max(m for _, m in g) * len(g) for g in plan.prefill),
                           decoding)
        self.room.pay_checkpoints(out.checkpoints)
        self.stepping.apply(out)  # tokens to text, events to clients, turns that end

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may prefill: what keeps the step near the pacer's gap (prefill_pacer.py) while
        somebody would wait on the step: an agent decoding at the top prompt's level or a more urgent one (its
        next token), or, with nothing decoding, an idle agent more urgent than the top prompt that is expected
        back (its turn would wait for the step to end). Otherwise all it may: a person's prompt more urgent
        than every decoding agent, or a batch script's prompts with nobody else about."""
        limit = self._prefill_limit
        if not self.pacer.enabled:
            return limit
        rows = [t.sequence for t in self.queues.by_uid.values() if t.sequence is not None and not t.sequence.paused]
        prompts = [s for s in rows if s.phase is Phase.PREFILL]
        if not prompts:
            return limit
        top = min(prompts, key=lambda s: s.rank).level
        if any(s.level <= top for s in rows if s.phase is Phase.DECODE):
            return self.pacer.budget(limit)
        if any(s.phase is Phase.DECODE for s in rows):
            return limit
        expected = self.agents.most_urgent_expected(EXPECTED_BACK_S)
        return self.pacer.budget(limit, expected_only=True) if expected is not None and expected < top else limit

    def _stepped(self) -> SteppedBatch:
        assert self._batch is not None, "the scheduler is closed"
        return self._batch

    def _remove_cancelled(self) -> None:
        for turn in [t for t in self.queues.by_uid.values() if t.cancel_reason is not None]:
            self.completion.complete(turn, turn.cancel_reason)  # type: ignore[arg-type]

    # -- failure and shutdown ------------------------------------------------------------------
    def fail_all(self, error: BaseException) -> None:
        """The batch raised: finish every running turn with an error and start a fresh batch."""
        message = f"{type(error).__name__}: {error}"
        for turn in list(self.queues.by_uid.values()):
            self.completion.complete(turn, FinishReason.ERROR, error=message, error_type="api_error")
        self._batch = self._factory(self.loaded, self.batch_settings, self._hooks)

    def cancel_all(self, reason: FinishReason = FinishReason.CANCELLED) -> None:
        for turn in list(self.queues.waiting):
            self.cancel(turn.request_id, reason)
        for turn in list(self.queues.by_uid.values()):
            turn.cancel(reason)
        self._remove_cancelled()

    def close(self) -> None:
        """Release the batch on the engine thread (its arrays belong to this thread's stream)."""
        self._batch = None
