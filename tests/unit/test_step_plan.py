"""The engine step's plan and grant (runner/step_plan.py, scheduler/step_room.py), on a tiny Llama.

The batch plans a step without changing anything, asks room in levels (its own chunk, the next token, a
padded pass's filler), and runs within what it was granted: a sequence granted less than it needs ends
out of room, one granted its chunk but not its next token prefills and then ends, and nothing in the
step reaches past the room it was given.
"""

from __future__ import annotations

import pytest

from engine.runtime.runner.batch import SequenceBatch
from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.runtime.runner.sequence import Phase, Sequence
from engine.runtime.runner.step_plan import StepPlan
from tests.support.byte_tokenizer import BOS
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit

PROMPTS = [[BOS, *b"a longer prompt that sets the width of the pass"], [BOS, *b"a shorter prompt here"]]


def batch_of(prompts: list[list[int]], prefill_step_size: int = 512) -> tuple[SequenceBatch, list[Sequence]]:
    loaded = loaded_tiny("llama")
    batch = SequenceBatch(loaded.model, prefill_step_size, 8)
    sequences = [Sequence(uid, SequenceKV.empty(loaded.spec), p, 4) for uid, p in enumerate(prompts)]
    for sequence in sequences:
        batch.insert(sequence)
    return batch, sequences


def grant_all(plan: StepPlan, cap: dict[int, int] | None = None) -> dict[int, int]:
    """Every level, up to ``cap`` positions per sequence where given (the scheduler's part, by hand)."""
    room: dict[int, int] = {}
    for ask in plan.asks:
        for n_tokens in ask.levels:
            if cap is not None and ask.sequence.uid in cap and n_tokens > cap[ask.sequence.uid]:
                break
            ask.sequence.kv.reserve(n_tokens)
            room[ask.sequence.uid] = n_tokens
    return room


def test_a_plan_changes_nothing_and_says_every_pass_and_level() -> None:
    batch, sequences = batch_of(PROMPTS)
    first, again = batch.plan(), batch.plan()
    assert [[(s.uid, m) for s, m in group] for group in first.prefill] == [[(0, len(PROMPTS[0]) - 1),
                                                                            (1, len(PROMPTS[1]) - 1)]]
    assert [(a.sequence.uid, a.levels) for a in first.asks] == [(a.sequence.uid, a.levels) for a in again.asks]
    assert all(s.kv.offset == 0 and s.prompt_fed == 0 and s.phase is Phase.PREFILL for s in sequences)
    width, short = len(PROMPTS[0]) - 1, len(PROMPTS[1]) - 1
    # Both prompts end in this pass (the last prompt token is fed by the first decode, in the same step): each
    # asks its chunk, then the position that decode writes; the short row also the filler of the padded pass.
    assert first.asks[0].levels == (width, width + 1)
    assert first.asks[1].levels == (short, short + 1, width)


def test_a_decoding_row_asks_for_its_next_position() -> None:
    batch, sequences = batch_of([PROMPTS[1]])
    batch.step(plan := batch.plan(), grant_all(plan))
    (ask,) = batch.plan().asks
    assert sequences[0].phase is Phase.DECODE and ask.levels == (sequences[0].kv.offset + 1,)


def test_a_long_prompt_asks_only_for_its_chunk_until_the_chunk_that_ends_it() -> None:
    prompt = [BOS, *b"a prompt longer than one prefill chunk of sixteen"]
    batch, _ = batch_of([prompt], prefill_step_size=16)
    assert [a.levels for a in batch.plan().asks] == [(16,)]


def test_a_row_granted_nothing_ends_out_of_room_and_one_granted_its_chunk_prefills() -> None:
    batch, sequences = batch_of(PROMPTS)
    plan = batch.plan()
    out = batch.step(plan, grant_all(plan, cap={0: 0}))
    assert out.out_of_room == [0] and 0 not in batch.sequences
    assert [p.uid for p in out.prefill] == [1] and sequences[1].prompt_fed == len(PROMPTS[1]) - 1


def test_a_row_granted_its_chunk_but_not_its_next_token_prefills_and_then_ends_out_of_room() -> None:
    prompt = [BOS, *b"one short prompt"]
    batch, sequences = batch_of([prompt])
    plan = batch.plan()
    out = batch.step(plan, grant_all(plan, cap={0: len(prompt) - 1}))
    assert [p.uid for p in out.prefill] == [0] and sequences[0].prompt_fed == len(prompt) - 1
    assert out.out_of_room == [0] and not out.tokens and not batch.sequences


def test_the_engine_step_runs_the_batch_inside_the_room_it_granted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a real engine: every step's run starts after its grant, and the batch never asks the
    scheduler for anything while it runs (no callback object reaches it)."""
    from engine.runtime.engine_thread.sync_client import run_turns
    from engine.runtime.engine_thread.engine import Engine
    from engine.domain.requests import GenerationRequest
    from engine.runtime.scheduler.step_room import StepRoom
    from tests.support.engine_settings import engine_settings

    order: list[str] = []
    grant, step = StepRoom.grant, SequenceBatch.step

    def granting(self, plan):
        order.append("grant")
        return grant(self, plan)

    def stepping(self, plan, room):
        order.append("run")
        for ask in plan.asks:  # whatever the run may reach, the grant reserved first: nothing left to grow
            kv = ask.sequence.kv
            assert kv.blocks_for(room.get(ask.sequence.uid, 0)) == kv.capacity_blocks()
        return step(self, plan, room)

    monkeypatch.setattr(StepRoom, "grant", granting)
    monkeypatch.setattr(SequenceBatch, "step", stepping)
    engine = Engine(loaded_tiny("llama"), engine_settings(64 << 20, 4, 32))
    engine.start()
    try:
        results = run_turns(engine, [GenerationRequest(f"a{i}", tuple(p), 6) for i, p in enumerate(PROMPTS)])
    finally:
        engine.stop()
    assert all(r.finish.error is None for r in results)
    assert order and order[0] == "grant" and all(a != b for a, b in zip(order, order[1:]))
