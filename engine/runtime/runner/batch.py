"""The batch: prefill chunks and pipelined decode steps over sequences' own caches.

A step is planned first (:meth:`SequenceBatch.plan`: its prefill passes and the room each cache needs,
see step_plan.py); the scheduler grants room for the plan; then :meth:`SequenceBatch.step` runs it within
that room, which is model work only: the batch never calls back into the scheduler. It does, in order:

1. prefill: up to ``prefill_step_size`` prompt tokens (the scheduler lowers it
   while rows decode, scheduler/prefill_pacer.py), most urgent prompt first
   (``prefill_order``), prompts of one length together in a pass; a chunk
   also ends at a checkpoint position; a chunk that leaves its prompt
   unfinished waits for the decode pass instead, where the backend can carry
   it there (``board``: one pass reads the weights for both);
2. launch a decode step for every decoding sequence (a ragged batch, see
   ``kv/ragged.py``) and start evaluating it asynchronously;
3. collect the tokens of the decode step launched by the previous call.

Decoding is pipelined as in mlx-lm: step t+1 is launched with step t's
tokens before they are read, so a sequence that ends at step t has already
fed its last token to its cache. That is the invariant the engine relies on:
a finished sequence's cache holds its prompt and every generated token.

A constrained sequence (structured outputs) samples from the tokens its
output format allows after the token it chose last, which is read only in
step 3. So a step with constrained rows launches the forward pass (2) without
sampling, reads the previous tokens (3) and feeds them to the constraints
while the pass computes, then masks those rows' logits and samples the whole
step (4). The pipeline stays whole: the next step still launches from tokens
not yet read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.domain.images import is_image_token
from engine.runtime.runner.backends.mlx import MlxBackend
from engine.runtime.runner.backends.protocol import Backend
from engine.runtime.runner import rotary_passes
from engine.runtime.runner.image_embeddings import ImageEmbedder, has_images
from engine.runtime.runner.kv.sequence_kv import CheckpointKind, SequenceKV
from engine.runtime.runner.sampling import sample
from engine.runtime.runner.token_masks import masked

from engine.runtime.runner.sequence import Phase, Sequence
from engine.runtime.runner.speculative_step import SpeculationSetup, SpeculativeSteps
from engine.runtime.runner.step_output import PrefillProgress, StepOutput, TokenOut
from engine.runtime.runner.step_plan import Room, RoomAsk, StepPlan

# Filler tokens a prefill row may carry to share a pass (see SequenceBatch._fits). SmolLM2 on a
# 2-core CPU computes about 40 tokens in the time one pass reads its weights (bench_forward_split).
PAD_SLACK = 32
# Prefix checkpoints a sequence keeps (at shared-prefix points of window and recurrent caches).
KEEP_PREFIX_CHECKPOINTS = 2
# A reply's first tokens during which less urgent prompts do not prefill beside it: a client sees a reply's text
# once the detokenizer knows where its first word ends (a BPE detokenizer: when the next word's token comes),
# so the person's time to first text spans the first few decode steps, which a paced chunk would lengthen.
REPLY_START_TOKENS = 4


@dataclass(slots=True)
class _Launched:
    rows: list[Sequence]
    # The step's tokens, still on the device; None until a step with constrained rows has their masks.
    sampled: mx.array | None
    logits: mx.array | None = None  # kept while ``sampled`` waits for masks


class SequenceBatch:
    def __init__(
        self, model: Any, prefill_step_size: int, max_batch_size: int, keep_turn_checkpoints: int = 1,
        backend: Backend | None = None, speculation: SpeculationSetup = SpeculationSetup(),
        images: ImageEmbedder | None = None,
    ) -> None:
        self.model = model
        # How the model is computed (runner/backends/): chosen once per engine; MLX's kernels by default.
        self.backend = backend if backend is not None else MlxBackend()
        self.prefill_step_size = prefill_step_size
        self.max_batch_size = max_batch_size
        self._room: Room = {}  # what the scheduler granted the step that runs now
        self.keep_turn_checkpoints = keep_turn_checkpoints
        self.keep_prefix_checkpoints = KEEP_PREFIX_CHECKPOINTS
        self.pad_prefill = True  # prompts of different lengths share a pass, padded (see _fits)
        self.ragged = self.backend.attach(model)
        # A vision model's image embeddings for prefill chunks that hold image tokens (None: a text model).
        self.images = images
        self.sequences: dict[int, Sequence] = {}
        self._launched: _Launched | None = None
        # Prompt chunks planned to ride this step's decode pass, as their planned passes (_riders), and those the
        # pass took (board).
        self._waiting_riders: list[list[tuple[Sequence, int]]] = []
        self._boarded: list[tuple[Sequence, int]] = []
        # Speculative decoding, where ``speculation.max_draft`` > 0 (speculative_step.SpeculationSetup).
        self.speculative = (SpeculativeSteps(self, speculation.max_draft, speculation.timed, speculation.draft_model)
                            if speculation.max_draft > 0 else None)

    # -- membership ---------------------------------------------------------------------
    def insert(self, sequence: Sequence) -> None:
        if len(sequence.prompt) < 1:
            raise ValueError("a sequence needs at least one prompt token to feed")
        self.sequences[sequence.uid] = sequence
        rotary_passes.assign(sequence.kv, sequence.positions)
        if sequence.prefill_left == 0:
            self._to_decode(sequence)

    def remove(self, uid: int) -> Sequence | None:
        """Stop a sequence now; its cache keeps what was fed (``sequence.fed``)."""
        sequence = self.sequences.pop(uid, None)
        if sequence is not None:
            sequence.phase = Phase.DONE
            rotary_passes.assign(sequence.kv, None)
            if self.speculative is not None:
                self.speculative.finish(sequence)
        return sequence

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def decoding(self) -> int:
        return sum(1 for s in self.sequences.values() if s.phase is Phase.DECODE and not s.paused)

    def decode_ready(self) -> list[Sequence]:
        """Rows that join the next decode step with a known input (a paused row waits, its input kept)."""
        return [s for s in self.sequences.values()
                if s.phase is Phase.DECODE and s.next_input is not None and not s.paused]

    def prefill_order(self) -> list[Sequence]:
        """The prompts this step may prefill, most urgent first (``Sequence.rank``, set by the scheduler).

        While a more urgent prompt waits for its first token, or its reply is in its first
        ``REPLY_START_TOKENS``, only prompts of its level share its step: a person's short warm turn is not held
        behind the chunks of subagents' long prompts. Paused rows wait.
        """
        waiting = sorted((s for s in self.sequences.values() if s.phase is Phase.PREFILL and not s.paused),
                         key=lambda s: s.rank)
        if not waiting:
            return waiting
        starting = (s.level for s in self.sequences.values()
                    if s.phase is Phase.DECODE and not s.paused and s.generated < REPLY_START_TOKENS)
        top = min([waiting[0].level, *starting])
        return [s for s in waiting if s.level == top]

    # -- the plan ------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """What the next step will do: its prefill passes, and how far each sequence's cache grows (its room
        ask). No side effects: the scheduler grants room for it, then :meth:`step` runs it."""
        plan = StepPlan(prefill=self._plan_prefill())
        completing: dict[int, int] = {}  # uid: the cache's length once this step's prefill ends its prompt
        for group in plan.prefill:
            width = max(m for _, m in group)
            for sequence, m in group:
                end = sequence.kv.offset + m
                filler = sequence.kv.offset + width if m < width else end
                if m == sequence.prefill_left:
                    completing[sequence.uid] = end
                    plan.asks.append(RoomAsk.of(sequence, end, filler, *self._decode_levels(sequence, end, True)))
                else:
                    plan.asks.append(RoomAsk.of(sequence, end, filler))
        speculating = bool(completing)  # a prompt that ends starts speculative steps (_to_decode)
        for sequence in self.sequences.values():
            if (sequence.phase is Phase.DECODE and not sequence.done and not sequence.paused
                    and sequence.uid not in completing):
                levels = self._decode_levels(sequence, sequence.kv.offset, speculating)
                plan.asks.append(RoomAsk.of(sequence, *levels))
        return plan

    def _decode_levels(self, sequence: Sequence, offset: int, starting: bool) -> tuple[int, ...]:
        """A row that decodes this step feeds one token at ``offset``; a speculative step feeds its drafts
        too (``starting``: speculative steps may begin within this step)."""
        speculative = self.speculative
        if speculative is None or not (speculative.active or starting):
            return (offset + 1,)
        return (offset + 1, offset + 1 + speculative.draft_bound(sequence))

    def _plan_prefill(self) -> list[list[tuple[Sequence, int]]]:
        """Up to ``prefill_step_size`` prompt tokens this step, in passes.

        Sequences go through the model together when their next chunks fit one
        pass (one pass reads the weights once: on a memory-bound device, several
        short prompts cost about what one does); each still writes only its own
        cache (ragged hook). Chunks of one length always group. On a model
        without sliding-window layers, a shorter chunk joins too, padded to the
        group's length (see ``_fits``): prompts of different lengths arriving
        together are then prefilled in one pass, as mlx-lm's batch does.
        """
        passes = []
        budget = self.prefill_step_size
        waiting = self.prefill_order()
        while waiting and budget > 0:
            first = waiting.pop(0)
            n = self._chunk_size(first, budget)
            group = [(first, n)]
            if self.ragged:
                for sequence in list(waiting):
                    if n * (len(group) + 1) > budget:
                        break
                    m = self._chunk_size(sequence, budget)
                    wider = max(n, m)
                    if wider * (len(group) + 1) <= budget and self._fits([*group, (sequence, m)], wider):
                        group.append((sequence, m))  # its whole chunk, the group padded to the longest
                        n = wider
                    elif self._chunk_size(sequence, n) == n:
                        group.append((sequence, n))  # the first n tokens of a longer chunk
                    else:
                        continue
                    waiting.remove(sequence)
            passes.append(group)
            budget -= n * len(group)
        return passes

    # -- the step -----------------------------------------------------------------------
    def step(self, plan: StepPlan, room: Room) -> StepOutput:
        """Run ``plan`` (from :meth:`plan`, nothing changed since) within ``room``: each sequence's cache may
        grow to the positions granted it; a sequence with no room for what it needs ends out of room."""
        self._room = room
        try:
            return self._step(plan)
        finally:
            self._room = {}

    def room(self, sequence: Sequence, n_tokens: int) -> bool:
        """Whether the room granted for this step lets ``sequence``'s cache hold ``n_tokens`` positions."""
        return n_tokens <= self._room.get(sequence.uid, 0)

    def _step(self, plan: StepPlan) -> StepOutput:
        started = time.perf_counter()
        out = StepOutput()
        self._prefill(plan, out)
        self._decode_step(out, started)
        self._prefill_alone(out)
        return out

    def _decode_step(self, out: StepOutput, started: float) -> None:
        """The step's decode pass: a speculative step's verification, or a pipelined launch."""
        speculative = self.speculative
        if speculative is not None and speculative.active:
            # Speculative: read the step in flight (drafts need every latest token), then verify drafts.
            previous, self._launched = self._launched, None
            if previous is not None:
                self._collect(previous, out)
            if speculative.step(out):
                if previous is None and not out.prefill and speculative.timed:  # steady: nothing else in its time
                    speculative.timed_step(out, time.perf_counter() - started)
                return
        previous = self._launched
        self._launched = self._launch(out)
        if speculative is not None and self._launched is not None:
            for row in self._launched.rows:  # tokens a speculative step chose, fed by this launch
                speculative.report_held(row, out)
        if previous is not None:
            self._collect(previous, out)
        if self._launched is not None and self._launched.sampled is None:
            self._sample_constrained(self._launched)
        if (previous is not None and speculative is not None and speculative.timed and not out.prefill
                and self._launched is not None):
            speculative.rates.plain_step(len(previous.rows), time.perf_counter() - started)

    def _prefill(self, plan: StepPlan, out: StepOutput) -> None:
        """Run the planned prefill passes, each with the rows that have room; the chunks that may ride the step's
        decode pass instead (:meth:`_riders`) wait for it (:meth:`board`)."""
        riding = self._riders(plan)
        waiting = {id(group) for group in riding}
        for group in plan.prefill:
            if id(group) not in waiting:
                self._prefill_pass(group, out)
        self._waiting_riders = riding

    def _prefill_pass(self, group: list[tuple[Sequence, int]], out: StepOutput) -> None:
        group = self._with_room(group, max(m for _, m in group), out)
        if group:
            self._prefill_group(group, max(m for _, m in group), out)

    def _riders(self, plan: StepPlan) -> list[list[tuple[Sequence, int]]]:
        """The planned passes whose chunks may go through this step's decode pass instead, where the backend
        can carry them (``carries_prompts``): one pass reads the weights once for the decoding rows and the
        prompts. Only chunks that leave their prompts unfinished (a last one ends in a pass of its own, and its
        sequence decodes in the same step), hold no image and end at no checkpoint; only while rows decode."""
        rows = [s.kv for s in self.decode_ready()]
        riding = [g for g in plan.prefill if all(self._may_ride(s, m) for s, m in g)] if rows else []
        chunks = [(s.kv, m) for group in riding for s, m in group]
        return riding if chunks and self.backend.carries_prompts(self.model, rows, chunks) else []

    @staticmethod
    def _may_ride(sequence: Sequence, m: int) -> bool:
        end = sequence.kv.offset + m
        return (m < sequence.prefill_left and not has_images(sequence.images, sequence.kv.offset, m)
                and end not in sequence.checkpoint_at and end != sequence.turn_checkpoint_at)

    def board(self, rows: list[SequenceKV], widths: list[int] | None = None) -> list[tuple[SequenceKV, list[int]]]:
        """The prompt chunks waiting to ride this step's decode pass (``rows``' caches, ``widths`` tokens each:
        one without), all of them where the backend carries them with these rows, else none (they take a pass
        of their own at the step's end). Each is a cache and the tokens it takes; :meth:`alight` after the pass."""
        riders = [(s, m) for group in self._waiting_riders for s, m in group]
        chunks = [(s.kv, m) for s, m in riders]
        if not riders or not self.backend.carries_prompts(self.model, rows, chunks, widths):
            return []
        if not all(self.room(s, s.kv.offset + m) for s, m in riders):
            return []  # (a rider without room ends out of room in its own pass, as any prompt does)
        self._boarded, self._waiting_riders = riders, []
        return [(s.kv, s.prompt[s.prompt_fed:s.prompt_fed + m]) for s, m in riders]

    def alight(self, out: StepOutput) -> None:
        """The pass that carried the boarded chunks ran: their sequences took them."""
        for sequence, m in self._boarded:
            sequence.kv.advanced(m)
            self._chunk_fed(sequence, m, out)
        self._boarded = []

    def _prefill_alone(self, out: StepOutput) -> None:
        """Chunks that waited to ride a decode pass that did not carry them: the passes planned for them."""
        groups, self._waiting_riders = self._waiting_riders, []
        for group in groups:
            self._prefill_pass(group, out)

    @staticmethod
    def _chunk_size(sequence: Sequence, budget: int) -> int:
        """The next chunk: within the budget, and ending at the next checkpoint position if one comes first."""
        n = min(budget, sequence.prefill_left)
        offset = sequence.kv.offset
        positions = [*sequence.checkpoint_at, sequence.turn_checkpoint_at]
        return min([n] + [p - offset for p in positions if offset < p < offset + n])

    def _has_prefill_room(self, sequence: Sequence, n: int, out: StepOutput) -> bool:
        if self.room(sequence, sequence.kv.offset + n):
            return True
        self._out_of_room(sequence, out)
        return False

    def _with_room(self, group: list[tuple[Sequence, int]], width: int,
                   out: StepOutput) -> list[tuple[Sequence, int]]:
        """The rows that have room: for their own chunk (else they end, out of room, as always), and
        for their filler when padded (else they wait for a later pass rather than fail for filler)."""
        kept = []
        for sequence, m in group:
            if not self._has_prefill_room(sequence, m, out):
                continue
            if m < width and len(group) > 1 and not self.room(sequence, sequence.kv.offset + width):
                continue
            kept.append((sequence, m))
        return kept

    def _fits(self, rows: list[tuple[Sequence, int]], width: int) -> bool:
        """Can these rows' chunks go through one pass ``width`` tokens wide?

        Equal chunks always can. Shorter ones are padded: a padded row writes
        filler K/V after its chunk and drops it again, and causal attention
        keeps its real positions from ever seeing the filler. A sliding-window
        layer's ring would overwrite positions it still needs, so only models
        without one pad. A row may carry up to a quarter of the width, or
        ``PAD_SLACK`` tokens, of filler: on a memory-bound device a pass costs a
        read of all the weights, which buys about that much arithmetic.
        """
        if all(m == width for _, m in rows):
            return True
        if not self.pad_prefill or any(s.kv.forgets for s, _ in rows):
            return False
        return all(0 < m and width - m <= max(width // 4, PAD_SLACK) for _, m in rows)

    def _prefill_group(self, group: list[tuple[Sequence, int]], n: int, out: StepOutput) -> None:
        """One pass over ``group``'s chunks (each row's ``m`` tokens, padded to ``n``)."""
        self._snapshot_turn_starts(group, out)
        chunks = [s.prompt[s.prompt_fed:s.prompt_fed + m] for s, m in group]
        embeddings = self._image_embeddings(group, chunks, n)
        if embeddings is not None:
            chunks = [[0 if is_image_token(t) else t for t in chunk] for chunk in chunks]  # (the model reads none)
        if embeddings is None and self.backend.carries_prompts(self.model, [], [(s.kv, m) for s, m in group]):
            # The backend runs a pass of prompt chunks alone as it runs those riding a decode step: unpadded.
            self.backend.decode(self.model, mx.zeros((0,), dtype=mx.uint32), [],
                                [(s.kv, chunk) for (s, _), chunk in zip(group, chunks)])
        elif len(group) == 1:
            self._run_model(mx.array(chunks), group[0][0].kv.caches(), embeddings)
        else:
            # Filler repeats a row's last token: any id works, the row's real positions never attend to it.
            inputs = mx.array([chunk + [chunk[-1]] * (n - len(chunk)) for chunk in chunks])
            self._run_model(inputs, self.backend.layer_views([s.kv for s, _ in group]), embeddings)
            for sequence, m in group:
                if m < n:
                    for layer in sequence.kv.layers:
                        layer.trim_to(layer.offset - (n - m))
        for sequence, m in group:
            sequence.kv.advanced(m)  # (recurrent rows are never padded: m == n for them)
        # Only the caches are evaluated: the logits of a prefill chunk are never computed.
        mx.eval([a for s, _ in group for a in s.kv.arrays()])
        for sequence, m in group:
            self._chunk_fed(sequence, m, out)

    def _chunk_fed(self, sequence: Sequence, m: int, out: StepOutput) -> None:
        """The sequence's cache took the next ``m`` tokens of its prompt: its checkpoints there, its progress."""
        chunk = sequence.prompt[sequence.prompt_fed:sequence.prompt_fed + m]
        sequence.prompt_fed += m
        sequence.fed.extend(chunk)
        at_checkpoint = sequence.kv.offset in sequence.checkpoint_at
        if at_checkpoint:
            sequence.kv.take_checkpoint(CheckpointKind.PREFIX, self.keep_prefix_checkpoints)
            out.checkpoints.append(sequence.uid)
        if sequence.kv.offset == sequence.turn_checkpoint_at and self._turn_checkpoint(sequence, out):
            sequence.checkpoint_prompt_end = False  # taken where the reply begins: none at the prompt's end
        out.prefill.append(PrefillProgress(sequence.uid, sequence.prompt_fed, sequence.prefill_total,
                                           at_checkpoint))
        if sequence.prefill_left == 0:
            self._to_decode(sequence)

    def _image_embeddings(self, group: list[tuple[Sequence, int]], chunks: list[list[int]], n: int) -> mx.array | None:
        """The pass's input embeddings (rows, n, hidden) when a row's chunk holds image tokens; else None (the
        model embeds the tokens itself). A padded row's filler repeats its last embedding."""
        if self.images is None or not any(has_images(s.images, s.kv.offset, m) for s, m in group):
            return None
        rows = []
        for (sequence, m), chunk in zip(group, chunks):
            row = self.images.chunk(chunk, sequence.kv.offset, sequence.images)
            if m < n:
                row = mx.concatenate([row, mx.repeat(row[-1:], n - m, axis=0)])
            rows.append(row)
        return mx.stack(rows)

    def _snapshot_turn_starts(self, group: list[tuple[Sequence, int]], out: StepOutput) -> None:
        """A turn about to go on from a recurrent state (the end of its agent's last turn): snapshot it there.

        The state stands one token short of the last turn's end, the furthest
        a later prompt that edits this turn's new messages can resume from; once
        this turn's tokens go through, the state is past it for good. Free to
        take (the arrays are referenced, and the pass replaces them).
        """
        for sequence, _ in group:
            kv = sequence.kv
            if sequence.prompt_fed == 0 and sequence.checkpoint_prompt_end and kv.offset > 0 and kv.spec.recurrent_groups:
                kv.take_checkpoint(CheckpointKind.TURN, self.keep_turn_checkpoints)
                out.checkpoints.append(sequence.uid)

    def _to_decode(self, sequence: Sequence) -> None:
        sequence.phase = Phase.DECODE
        sequence.next_input = sequence.prompt[-1]
        sequence.at_prompt_end = True
        if self.speculative is not None:
            self.speculative.start(sequence)
            self.speculative.active = True  # (its first step looks for drafts: a prompt may end mid-copy)

    def _launch(self, out: StepOutput) -> _Launched | None:
        """Launch a decode step for every decoding row, carrying the prompt chunks waiting to ride it where the
        backend can (:meth:`board`)."""
        previous = self._launched
        carried = [s for s in previous.rows if not s.done and not s.paused] if previous is not None else []
        joining = self.decode_ready()
        rows = [s for s in carried + joining if self.has_room(s, out)][: self.max_batch_size]
        if not rows:
            return None
        self.checkpoint_prompt_ends(rows, out)
        inputs = self._inputs(rows, previous)
        for s in rows:
            if s.next_input is not None:
                s.fed.append(s.next_input)
                s.next_input = None
        chunks = self.board([s.kv for s in rows])
        logits = self.backend.decode(self.model, inputs, [s.kv for s in rows], chunks) if chunks else \
            self._forward(rows, inputs)
        self.alight(out)
        for s in rows:
            s.kv.advanced(1)
        if any(s.may_mask() for s in rows):
            mx.async_eval(logits)  # sampled once the rules have this step's inputs (_sample_constrained)
            return _Launched(rows, None, logits)
        sampled = _sample(logits, rows, self.backend)
        mx.async_eval(sampled)
        return _Launched(rows, sampled)

    def _sample_constrained(self, launched: _Launched) -> None:
        """Sample a launched step whose ruled rows needed the tokens just read: each row's mask is what its
        format or its reasoning allows after every token it has chosen (all decided by now)."""
        assert launched.logits is not None
        masks = [(i, mask) for i, s in enumerate(launched.rows) if not s.done and (mask := s.mask()) is not None]
        launched.sampled = _sample(masked(launched.logits, masks), launched.rows, self.backend)
        launched.logits = None
        mx.async_eval(launched.sampled)

    def has_room(self, sequence: Sequence, out: StepOutput) -> bool:
        if sequence.done:
            return False
        if self.room(sequence, sequence.kv.offset + 1):
            return True
        self._out_of_room(sequence, out)
        return False

    def _out_of_room(self, sequence: Sequence, out: StepOutput) -> None:
        out.out_of_room.append(sequence.uid)
        self.remove(sequence.uid)

    def _inputs(self, rows: list[Sequence], previous: _Launched | None) -> mx.array:
        """Each row's next input: its last sampled token (still on the device) or a known int."""
        index = {id(s): i for i, s in enumerate(previous.rows)} if previous is not None else {}
        parts: list[mx.array] = []
        for s in rows:
            if s.next_input is not None:
                parts.append(mx.array([s.next_input], dtype=mx.uint32))
            else:
                i = index[id(s)]
                assert previous is not None and previous.sampled is not None
                parts.append(previous.sampled[i:i + 1].astype(mx.uint32))
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]

    def _run_model(self, inputs: mx.array, cache: Any, embeddings: mx.array | None = None) -> mx.array:
        return self.backend.forward(self.model, inputs, cache, embeddings)

    def _forward(self, rows: list[Sequence], inputs: mx.array) -> mx.array:
        return self.backend.decode(self.model, inputs, [s.kv for s in rows])

    def checkpoint_prompt_ends(self, rows: list[Sequence], out: StepOutput) -> None:
        """Rows about to feed their prompt's last token hold the prompt but that token: checkpoint there.

        One position short of the prompt end serves both ways a later prompt
        can come back: one that diverges after this prompt (inside the reply)
        resumes here and recomputes one token more; the same prompt re-sent (a
        client's retry) needs the logits of its last token, so it can resume only
        from before it, and a checkpoint at the very end would be of no use to it.
        """
        for s in rows:
            if s.at_prompt_end:
                s.at_prompt_end = False
                if s.checkpoint_prompt_end:
                    self._turn_checkpoint(s, out)

    def _turn_checkpoint(self, s: Sequence, out: StepOutput) -> bool:
        """The turn's checkpoint, for caches that cannot go back otherwise (a window, a recurrent state)."""
        if not (s.checkpoint_prompt_end and s.kv.forgets):
            return False
        s.kv.take_checkpoint(CheckpointKind.TURN, self.keep_turn_checkpoints)
        out.checkpoints.append(s.uid)
        return True

    def _collect(self, launched: _Launched, out: StepOutput) -> None:
        assert launched.sampled is not None
        tokens = launched.sampled.tolist()
        current = {id(s) for s in self._launched.rows} if self._launched is not None else set()
        for sequence, token in zip(launched.rows, tokens):
            if sequence.done:
                continue
            decision = sequence.decide(token)
            if id(sequence) in current:
                sequence.fed.append(token)  # the launch just made fed it to the cache
            else:
                sequence.next_input = token  # it goes in with the next launch, as a known int
            out.tokens.append(TokenOut(sequence.uid, token, decision.stop, decision.released))
            if decision.stop is not None:
                self.remove(sequence.uid)
            elif self.speculative is not None:
                self.speculative.observe(sequence, token)


def _sample(logits: mx.array, rows: list[Sequence], backend: Backend) -> mx.array:
    return sample(logits, [s.sampler for s in rows], backend.top_k_of_logits)
