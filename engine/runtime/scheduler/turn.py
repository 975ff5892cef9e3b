"""One admitted or waiting turn and its bookkeeping.

The scheduler's parts read a turn's fields freely and change them only
through its methods below (a test holds them to it), so what can happen to a
turn, and in which words, is all here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from engine.runtime.tiers.agents import AgentRecord
from engine.runtime.runner.sequence import Sequence
from engine.domain.forensics import TurnForensics
from engine.runtime.tiers.hot import Holder, ReusePlan
from engine.domain.repetition import RepetitionGuard
from engine.domain.requests import (EngineEvent, EventSink, FinishEvent, FinishReason, GenerationRequest, LoopClosed,
                                    Usage)
from engine.runtime.runner.routed_text import RoutedText


# Room a side request (a title, a probe) reserves for its answer at admission: Claude Code's side requests ask for
# at most 32 tokens (the API layer's AUX_MAX_TOKENS); a longer one (on a small "haiku" model) grows past it.
SIDE_ANSWER_RESERVE = 32


def admission_tokens(request: GenerationRequest) -> int:
    """Positions reserved when a turn is admitted. A side request may not evict a conversation's cache to grow,
    so it gets room for its whole answer up front (up to SIDE_ANSWER_RESERVE tokens): it is served whole or
    refused at once, never cut short mid-answer. Other turns grow as they go."""
    n = len(request.prompt_tokens)
    return n + max(1, min(request.max_tokens, SIDE_ANSWER_RESERVE)) if request.auxiliary else n + 1


class TurnPhase(str, enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Turn:
    request: GenerationRequest
    sink: EventSink
    submitted_at: float = field(default_factory=time.monotonic)
    phase: TurnPhase = TurnPhase.WAITING
    agent: AgentRecord | None = None
    uid: int | None = None
    plan: ReusePlan | None = None
    # Whose cache the turn runs on: its agent's, or a side cache that is thrown away after.
    holder: Holder | None = None
    sequence: Sequence | None = None
    text: RoutedText | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    # clock.now() at the first token: what decisions (max_output_s) read, the same on every rank.
    first_token_tick: float | None = None
    generated: int = 0
    prefill_done: int = 0
    cancel_reason: FinishReason | None = None
    # Early sharing (shared_prefill.py): the prompt position at which the cache is offered to turns
    # with the same prefix while this one is still prefilling; 0 when not offered.
    share_at: int = 0
    published: bool = False
    # The hand-off between the pool and the batch: seconds from admission to the first prefill
    # chunk, from the last token to the cache settled, and bytes of KV copied on the way.
    handoff_in_s: float = 0.0
    handoff_out_s: float = 0.0
    copied_bytes: int = 0
    copied_mark: int = 0  # the cache's copy counter when the turn was admitted
    guard: RepetitionGuard = field(default_factory=lambda: RepetitionGuard(0))
    # The agent's tier and model as the turn first met it (admission may be retried), and the
    # forensics record made when it was admitted.
    arrival: tuple[str, bool] | None = None
    forensics: TurnForensics | None = None
    # Why the pool could not grow the turn, when it could not (the note its capacity finish carries).
    room_note: str | None = None
    # Its priority level (domain/priority.py) and its place in the order turns are served (virtual arrival:
    # earlier first); set when it is submitted and when the operator changes its agent's level.
    level: int = 1
    order: float = 0.0
    # clock.now() when its agent was paused mid-turn (None: not paused): the pause does not count against
    # max_output_seconds.
    paused_at: float | None = None
    # When its latest token came (time.monotonic): the gap to the next one is metered per class.
    last_token_at: float | None = None

    # -- what happens to a turn ----------------------------------------------------------------
    def place(self, level: int, order: float) -> None:
        """Its priority level and its place in the serving order (virtual arrival: earlier first)."""
        self.level, self.order = level, order

    def arrive(self, tier: str, model_changed: bool) -> None:
        """Its agent's tier, and whether the cache was another model's, as the turn first met them (kept when
        admission is tried again)."""
        if self.arrival is None:
            self.arrival = (tier, model_changed)

    def take_request(self, request: GenerationRequest) -> None:
        """Its request as admitted: the prompt with the last reply's cached tokens spliced back (reply_splice.py)."""
        self.request = request

    def take_cache(self, agent: AgentRecord, plan: ReusePlan, holder: Holder) -> None:
        """Its agent, the reuse planned, and whose cache it runs on (its agent's, or a side cache)."""
        self.agent, self.plan, self.holder = agent, plan, holder

    def replan(self, plan: ReusePlan) -> None:
        """Less of the cache was kept than planned, or a stored prefix came from disk instead."""
        self.plan = plan

    def cache_ready(self, copied_bytes: int, copied_mark: int, forensics: TurnForensics, handoff_in_s: float) -> None:
        """Its cache is prepared: bytes copied on the way, the cache's copy counter now, how the prompt met the
        cache, and the seconds it took."""
        self.copied_bytes, self.copied_mark = copied_bytes, copied_mark
        self.forensics, self.handoff_in_s = forensics, handoff_in_s

    def admit(self, uid: int, sequence: Sequence, text: RoutedText, guard: RepetitionGuard, share_at: int) -> None:
        """It enters the batch as ``sequence``; ``share_at``: the prompt position its cache is offered at to
        turns with the same prefix while it still prefills (0: not offered)."""
        self.uid, self.sequence, self.text, self.guard, self.share_at = uid, sequence, text, guard, share_at
        self.phase, self.admitted_at = TurnPhase.PREFILLING, time.monotonic()

    def prefilled(self, done: int) -> None:
        """``done`` of its prompt tokens to prefill are in its cache."""
        self.prefill_done = done

    def shared_early(self) -> None:
        """Its cache so far was offered to waiting turns with the same prefix (shared_prefill.py)."""
        self.published = True

    def first_token(self, tick: float) -> None:
        """Its first token came: the prompt is all in, it decodes from now (``tick``: clock.now())."""
        self.first_token_at, self.first_token_tick = time.monotonic(), tick
        self.phase = TurnPhase.DECODING
        self.prefill_done = self.to_prefill

    def token(self, now: float) -> float | None:
        """A token came at ``now`` (time.monotonic); the gap since the one before (None: the first, or the
        first after a pause)."""
        gap = None if self.last_token_at is None else now - self.last_token_at
        self.generated += 1
        self.last_token_at = now
        return gap

    def pause(self, tick: float) -> None:
        """Its agent was paused mid-turn (``tick``: clock.now()): its sequence waits in the batch."""
        assert self.sequence is not None
        self.sequence.paused = True
        self.paused_at = tick

    def resume(self, tick: float) -> None:
        """Its agent goes on: the pause is no gap between tokens and no generation time."""
        assert self.sequence is not None
        self.sequence.paused = False
        self.last_token_at = None
        if self.paused_at is not None and self.first_token_tick is not None:
            self.first_token_tick += tick - self.paused_at
        self.paused_at = None

    def no_room(self, note: str) -> None:
        """Why the pool could not grow it (the note its capacity finish carries)."""
        self.room_note = note

    def cancel(self, reason: FinishReason) -> None:
        """End it at the next step, for ``reason``."""
        self.cancel_reason = reason

    def sink_failed(self) -> None:
        """Its client's sink raised: nobody listens any more, so it ends unless it already has."""
        self.sink = _nobody_listens
        if self.phase is not TurnPhase.DONE:
            self.cancel_reason = FinishReason.CANCELLED

    def finish(self) -> None:
        self.phase = TurnPhase.DONE

    def settled(self, handoff_out_s: float, copied_now: int | None) -> None:
        """Its cache is settled after the last token (``copied_now``: the cache's copy counter, None when it ran
        on no cache): the seconds that took, and the bytes copied since admission."""
        if copied_now is not None:
            self.copied_bytes += copied_now - self.copied_mark
        self.handoff_out_s = handoff_out_s

    @property
    def on_own_cache(self) -> bool:
        """Whether the turn writes its agent's cache (a side request on a conversation does not)."""
        return self.holder is not None and self.holder is self.agent

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def reused(self) -> int:
        return self.plan.reused if self.plan else 0

    @property
    def admission_tokens(self) -> int:
        return admission_tokens(self.request)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def to_prefill(self) -> int:
        return self.prompt_len - self.reused

    @property
    def reasoning_tokens(self) -> int:
        reasoning = self.sequence.reasoning if self.sequence is not None else None
        return reasoning.reasoning_tokens if reasoning is not None else 0

    @property
    def cache_len(self) -> int:
        """Tokens the sequence's KV cache holds once the current step is done."""
        return self.reused + self.prefill_done + self.generated

    def usage(self) -> Usage:
        now = time.monotonic()
        ttft = (self.first_token_at - self.submitted_at) if self.first_token_at else None
        decode_rate = None
        if self.first_token_at and self.generated > 1 and now > self.first_token_at:
            decode_rate = (self.generated - 1) / (now - self.first_token_at)
        return Usage(
            prompt_tokens=self.prompt_len,
            reused_tokens=self.reused,
            prefilled_tokens=self.prompt_len - self.reused,
            generated_tokens=self.generated,
            reasoning_tokens=self.reasoning_tokens,
            reuse_source=self.plan.source if self.plan else "none",
            reuse_note=self.plan.note if self.plan else None,
            ttft_s=ttft,
            decode_tok_s=decode_rate,
            duration_s=now - self.submitted_at,
            handoff_in_s=self.handoff_in_s,
            handoff_out_s=self.handoff_out_s,
            copied_bytes=self.copied_bytes,
            cache_outcome=self.forensics.outcome.value if self.forensics else "new_agent",
            diverged_at=self.forensics.divergence.token if self.forensics and self.forensics.divergence else None,
            speculation=self.sequence.speculation.tally if self.sequence and self.sequence.speculation else None,
            loop_closed=self.loop_closed,
            model=self.request.model_id or None,
        )

    @property
    def loop_closed(self) -> LoopClosed | None:
        """The loop its constrained reply was steered closed from, with the tokens that saved."""
        constraint = self.sequence.constraint if self.sequence is not None else None
        if constraint is None or constraint.closed is None:
            return None
        return replace(constraint.closed, tokens_left=max(0, self.request.max_tokens - self.generated))

    def finish_event(self, reason: FinishReason, **extra: object) -> FinishEvent:
        return FinishEvent(self.request_id, reason, self.usage(), **extra)  # type: ignore[arg-type]


def _nobody_listens(event: EngineEvent) -> None:
    """The sink of a turn whose own sink failed."""
