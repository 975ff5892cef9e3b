"""One admitted or waiting turn and its bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from engine.runtime.tiers.agents import AgentRecord
from engine.runtime.runner.sequence import Sequence
from engine.domain.forensics import TurnForensics
from engine.runtime.tiers.hot import Holder, ReusePlan
from engine.domain.repetition import RepetitionGuard
from engine.domain.requests import EventSink, FinishEvent, FinishReason, GenerationRequest, LoopClosed, Usage
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
