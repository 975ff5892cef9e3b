"""Speculative decoding inside the continuous batch: drafts from each sequence's own history, verified together.

While no sequence has a draft, the batch decodes as always: pipelined, one
token a sequence a step, each step launched before the previous one's tokens
are read. A draft needs the sequence's latest token as a number, so when a
collected token shows that some sequence's history continues something it
has seen before (``drafting.LookupDrafter``), the batch switches to
speculative steps: it reads the step in flight, looks up every decoding
sequence's drafts, and runs one pass in which each sequence feeds its last
token and its drafts (one token for a sequence without any): the backend's
``verify``. Each sequence keeps the drafts the model would have produced plus
one token of its own (``speculation.accepted_tokens``), and its cache is cut
back past the rejected positions (``SequenceKV.take_back``). When a step
finds no draft anywhere, the batch goes back to pipelined steps.

With a draft model (``--speculate draft``), the drafts come from it instead
(``model_drafting.ModelDrafter``, one per sequence, kept per agent between
turns by ``DraftCaches``): it guesses after any token, at the price of its
own steps, so each step first allocates how many drafts pay and only those
are made; the batch stays in speculative steps while they pay (``step_rates``).

A sequence speculates only where its cache can be cut back
(``SequenceKV.can_take_back``: full attention always, a sliding window while
the step's positions overwrite nothing still needed, chunked windows and
recurrent states never); it then rides in the speculative steps with one
token. How many tokens a sequence drafts follows its recent acceptance
(``drafting.DraftLength``).

Tokens come out as they would from plain decoding: several a step for a
sequence whose drafts were kept, cut at the first end-of-sequence token or
``max_tokens``. The cache then holds the last token fed and the kept drafts,
``sequence.fed`` says which, and the sequence's next input is the token the
model chose itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.domain.images import is_image_token
from engine.runtime.runner.drafting import DraftLength, Drafter, LookupDrafter, allocate_drafts
from engine.runtime.runner.model_drafting import DraftCaches, ModelDrafter
from engine.runtime.runner.sampling import sample
from engine.runtime.runner.sequence import Sequence
from engine.runtime.runner.step_output import StepOutput, TokenOut
from engine.runtime.runner.step_rates import StepRates
from engine.runtime.runner.speculation import Speculation, accepted_tokens, greedy_tokens
from engine.runtime.runner.token_masks import masked
from engine.runtime.runner.verifying_batch import VerifyingBatch

# Tokens per sequence the batch stays pipelined after a step found drafts that would not pay.
QUIET_TOKENS = 8
NO_LIMIT = 1 << 30


@dataclass(frozen=True, slots=True)
class SpeculationSetup:
    """How a batch speculates: ``max_draft``, the most tokens a sequence drafts in one step (0: never);
    ``draft_model``, where drafts come from (None: looked up in each sequence's history); ``timed``, whether
    the batch may stop speculating by its own clock (not under lockstep: ranks decide alike)."""

    max_draft: int = 0
    timed: bool = True
    draft_model: Any = None


class SpeculativeSteps:
    """The batch's speculative steps; ``max_draft``: the most tokens a sequence drafts in one step;
    ``draft_model``: where drafts come from (None: looked up in each sequence's history)."""

    def __init__(self, batch: VerifyingBatch, max_draft: int, timed: bool = True, draft_model: Any = None) -> None:
        self.batch = batch
        self.max_draft = max_draft
        self.draft_caches = (DraftCaches(draft_model, batch.max_batch_size, batch.prefill_step_size)
                             if draft_model is not None else None)
        self.timed = timed  # whether step_rates may stop speculation by this process's clock
        self.active = False  # the next step is speculative (else pipelined)
        self.rates = StepRates()  # whether speculative steps pay for the batch as it runs now
        self._rows = 0  # rows of the last speculative step
        self._cost: float | None = None  # the backend's cost of one more row in a pass (draft_row_cost)
        self._token_cost: float | None = None  # and of one more drafted token (draft_token_cost)
        self._draft_cost_share: float | None = None  # a draft model's step against a pass of the served model
        self._quiet = 0  # tokens to read before a draft may switch the batch to speculative steps again

    def start(self, sequence: Sequence) -> None:
        """A sequence begins decoding: index its history (the cached context and the whole prompt)."""
        if not _may_draft(sequence):
            return
        history = [*sequence.context, *sequence.prompt]
        if self.draft_caches is not None and any(is_image_token(token) for token in history):
            return  # a draft model has no vision: it cannot read a prompt with images
        drafter: Drafter = (self.draft_caches.lend(sequence.owner, history) if self.draft_caches is not None
                            else LookupDrafter(history))
        sequence.speculation = Speculation(drafter, DraftLength(self.max_draft))

    def draft_bound(self, sequence: Sequence) -> int:
        """At most how many tokens ``sequence`` drafts in the coming step (the room the batch asks for it; no
        side effects, unlike the draft length's ``next``)."""
        if not self.rates.allowed() or sequence.held_stop is not None:
            return 0
        speculation = sequence.speculation
        if speculation is None:  # it starts decoding within the step: ``start`` gives it a fresh draft length
            k = DraftLength(self.max_draft).k if _may_draft(sequence) else 0
        else:
            k = speculation.length.k
        return max(0, min(k, sequence.max_tokens - sequence.generated - 1))

    def finish(self, sequence: Sequence) -> None:
        """A sequence left the batch: its draft model's cache waits for its agent's next turn."""
        if self.draft_caches is not None and sequence.speculation is not None:
            drafter = sequence.speculation.drafter
            if isinstance(drafter, ModelDrafter):
                self.draft_caches.give_back(drafter)

    def observe(self, sequence: Sequence, token: int) -> None:
        """A pipelined step's token, read: keep the history whole, and speculate from the next step on when
        it shows a draft."""
        speculation = sequence.speculation
        if speculation is None:
            return
        speculation.drafter.extend([token])
        if self._quiet > 0:
            self._quiet -= 1
            return
        if (not self.active and self.rates.allowed() and speculation.length.next() > 0
                and speculation.drafter.has_draft()):
            self.active = True

    def _row_cost(self) -> float:
        if self._cost is None:
            self._cost = self.batch.backend.draft_row_cost(self.batch.model)
        return self._cost

    def _drafted_token_cost(self) -> float:
        if self._token_cost is None:
            self._token_cost = self.batch.backend.draft_token_cost(self.batch.model)
        return self._token_cost

    def timed_step(self, out: StepOutput, seconds: float) -> None:
        """A steady speculative step took ``seconds``."""
        self.rates.speculative_step(self._rows, len(out.tokens), seconds)
        if not self.rates.allowed():
            self.active = False  # the batch's speculative steps fell behind plain ones: pipelined for a while

    def step(self, out: StepOutput) -> bool:
        """One speculative step over every decoding sequence; False (nothing run) when none has a draft."""
        batch = self.batch
        rows = batch.decode_ready()[: batch.max_batch_size]
        drafts, offered = self._allocated_drafts(rows)
        if not any(drafts.values()):
            self.active = False
            if offered:  # drafts that would not pay with this batch: pipelined steps for a while
                self._quiet = QUIET_TOKENS * len(rows)
            return False
        kept_rows = []
        for s in rows:
            d = drafts[id(s)]
            if d and not batch.room(s, s.kv.offset + 1 + len(d)):
                drafts[id(s)] = d = []
            if d or batch.has_room(s, out):
                kept_rows.append(s)
        rows = kept_rows
        self._rows = len(rows)
        if not rows:
            return True
        batch.checkpoint_prompt_ends(rows, out)
        inputs = [[s.next_input, *drafts[id(s)]] for s in rows]
        for s in rows:
            s.next_input = None
        undo = {id(s): s.kv.undo_for(len(fed)) for s, fed in zip(rows, inputs) if len(fed) > 1}
        kvs = [s.kv for s in rows]
        chunks = batch.board(kvs, [len(fed) for fed in inputs])
        logits, in_place = batch.backend.verify(batch.model, inputs, kvs, chunks)
        batch.alight(out)
        logits = masked(logits, self._masks(rows, inputs))
        mx.eval(logits, [a for s in rows for a in s.kv.arrays()])
        greedy = mx.argmax(logits, axis=-1).tolist() if any(s.sampler is None for s in rows) else []
        start = 0
        for s, fed in zip(rows, inputs):
            width = len(fed)
            if s.held_stop is not None:  # it drafted nothing: the held token that ends it is all it fed
                start += width
                s.kv.advanced(1)
                s.fed.append(fed[0])
                self.report_held(s, out)
                continue
            self.report_held(s, out)
            if s.sampler is None:
                emitted = greedy_tokens(greedy[start:start + width], fed[1:])
            elif width == 1:  # no drafts: sampled as a pipelined step samples it (the same draws from its key)
                emitted = sample(logits[start:start + 1], [s.sampler], batch.backend.top_k_of_logits).tolist()
            else:
                emitted = accepted_tokens(logits[start:start + width], fed[1:], s.sampler,
                                          batch.backend.top_k_of_logits)
            start += width
            self._settle(s, fed, emitted, in_place, undo.get(id(s), ()), out)
        return True

    @staticmethod
    def _masks(rows: list[Sequence], inputs: list[list[int]]) -> list[tuple[int, Any]]:
        """The ruled rows' masks, at their logits' rows (one each: a ruled row feeds one token, no drafts)."""
        masks, start = [], 0
        for s, fed in zip(rows, inputs):
            mask = s.mask() if s.held_stop is None else None
            if mask is not None:
                masks.append((start, mask))
            start += len(fed)
        return masks

    def _allocated_drafts(self, rows: list[Sequence]) -> tuple[dict[int, list[int]], bool]:
        """Each row's drafts for this step, as many as raise tokens per second (``allocate_drafts``), and whether
        any row had drafts to offer. Looked-up drafts are free, so all of them are looked up and the allocation
        cuts them; a draft model's cost, so the allocation comes first and it makes only the drafts that will
        be verified."""
        wanted = {id(s): self._draft_length(s) for s in rows}
        if self.draft_caches is None:
            drafts = {id(s): s.speculation.drafter.propose(wanted[id(s)]) if wanted[id(s)] else [] for s in rows}
            offered = [s for s in rows if drafts[id(s)]]
            offers = [(len(drafts[id(s)]), s.speculation.length.acceptance) for s in offered]
            counts = allocate_drafts(offers, self._row_cost(), len(rows), token_cost=self._drafted_token_cost())
            return {**drafts, **{id(s): drafts[id(s)][:n] for s, n in zip(offered, counts)}}, bool(offered)
        offered = [s for s in rows if wanted[id(s)]]
        counts = allocate_drafts([(wanted[id(s)], s.speculation.length.acceptance) for s in offered],
                                 self._row_cost(), len(rows), self._draft_cost(), self._drafted_token_cost())
        drafts = {id(s): [] for s in rows}
        for s, n in zip(offered, counts):
            if n:
                drafts[id(s)] = s.speculation.drafter.propose(n)
        return drafts, bool(offered)

    def _draft_length(self, sequence: Sequence) -> int:
        """How many tokens ``sequence`` may draft this step: its draft length, within its ``max_tokens`` and what
        its cache can take back (0: none)."""
        speculation = sequence.speculation
        if speculation is None or sequence.held_stop is not None or not self.rates.allowed():
            return 0
        k = min(speculation.length.next(), sequence.max_tokens - sequence.generated - 1, _reasoning_room(sequence))
        while k > 0 and not sequence.kv.can_take_back(1 + k):
            k -= 1
        return max(k, 0)

    def _draft_cost(self) -> float:
        if self._draft_cost_share is None:
            assert self.draft_caches is not None
            self._draft_cost_share = self.draft_caches.cost_share(self.batch.model)
        return self._draft_cost_share

    def report_held(self, s: Sequence, out: StepOutput) -> bool:
        """A pass just fed ``s``'s held token: report it. True when that ended the sequence (it is removed)."""
        if s.held_token is None:
            return False
        token, stop, released = s.held_token, s.held_stop, s.held_released
        s.held_token, s.held_stop, s.held_released = None, None, None
        out.tokens.append(TokenOut(s.uid, token, stop, released))
        if stop is None:
            return False
        self.batch.remove(s.uid)
        return True

    def _settle(self, s: Sequence, fed: list[int], emitted: list[int], in_place: bool, undo: Any,
                out: StepOutput) -> None:
        """Keep what the model would have produced: report the kept drafts (in the cache) up to a finish, cut the
        cache back to the fed tokens kept, and hold the model's own token as the next input."""
        accepted = len(emitted) - 1
        decided = 0
        for token in emitted:
            decided += 1
            decision = s.decide(token)
            if decided > accepted:  # the model's own token: reported once the next pass feeds it
                s.held_token, s.held_stop, s.held_released = token, decision.stop, decision.released
                break
            out.tokens.append(TokenOut(s.uid, token, decision.stop, decision.released))
            if decision.stop is not None:
                break
        keep = 1 + min(decided, accepted)  # the last token fed, and the drafts kept up to a finish
        s.kv.take_back(len(fed) - keep, in_place, undo)
        s.kv.advanced(keep)
        s.fed.extend(fed[:keep])
        if s.speculation is not None:
            s.speculation.verified(len(fed) - 1, accepted, len(emitted))
            s.speculation.drafter.extend(emitted[:decided])
        if s.held_token is not None:
            s.next_input = s.held_token
        else:
            self.batch.remove(s.uid)  # a kept draft ended it



def _may_draft(sequence: Sequence) -> bool:
    """A seeded sampled request does not draft: its tokens would then depend on when the batch speculates (on
    the other sequences), and a seed promises the same tokens whatever shares the batch. Nor does a constrained
    one: its drafts would need its format's mask after each of them (it rides with one token a step)."""
    if sequence.sampler is not None and sequence.sampler.params.seed is not None:
        return False
    return sequence.constraint is None


def _reasoning_room(sequence: Sequence) -> int:
    """Drafts a reasoning row may verify this step: as many as cannot reach its budget (its rule would force a
    token a draft cannot know); none while a rule stands. Any without a reasoning format."""
    return NO_LIMIT if sequence.reasoning is None else sequence.reasoning.draft_room(NO_LIMIT)
