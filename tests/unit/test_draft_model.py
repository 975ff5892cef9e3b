"""Speculative decoding with a draft model (--speculate draft): the drafter proposes the draft model's own
greedy tokens after whatever was verified, keeps each agent's cache between turns, and the served model's
tokens come out exactly as without it; a model that cannot draft is refused with the reason."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from engine.domain.requests import GenerationRequest, SamplingParams
from engine.errors import ModelLoadError
from engine.models.draft_model import DraftModel, check_draft_fits
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from engine.runtime.runner.model_drafting import DraftCaches, ModelDrafter
from engine.settings import Settings
from tests.support.byte_tokenizer import BOS, EOS, ByteTokenizer
from tests.support.engine_settings import engine_settings
from tests.support.reference import reference_greedy
from tests.support.tiny_models import loaded_tiny, tiny_gemma3, tiny_llama

HISTORY = [BOS, *b"def f(x): return x + 1\nprint(f(2))\n"]


def test_a_drafter_proposes_the_draft_models_greedy_tokens_after_each_verification() -> None:
    draft = tiny_llama(seed=1)
    drafter = ModelDrafter(draft, HISTORY)
    first = drafter.propose(5)
    assert first == reference_greedy(draft, HISTORY, 5, set())
    assert drafter.fed == len(HISTORY) + 4  # the history, then its own first four guesses
    # The served model kept two drafts and chose another token than the third: the cache keeps the two (fed
    # already), drops the rest, and the draft model computes only the new token before guessing again.
    other = (first[2] + 1) % 256
    drafter.extend([*first[:2], other])
    before = drafter.fed
    second = drafter.propose(4)
    assert second == reference_greedy(draft, [*HISTORY, *first[:2], other], 4, set())
    assert drafter.fed - before == 1 + 3
    # None kept and the served model's own token ends the step: one token fed again.
    drafter.extend([(second[0] + 7) % 256])
    before = drafter.fed
    assert drafter.propose(2) == reference_greedy(draft, drafter.tokens, 2, set())
    assert drafter.fed - before == 1 + 1


def test_an_agents_drafter_waits_for_its_next_turn_and_feeds_only_what_is_new() -> None:
    draft = tiny_llama(seed=1)
    caches = DraftCaches(draft, kept=1, prefill_step_size=16)  # (chunks of 16: a long history in several passes)
    drafter = caches.lend("a", HISTORY)
    reply = drafter.propose(3)
    drafter.extend(reply)
    caches.give_back(drafter)
    follow = [*HISTORY, *reply, *b"\nnext"]
    again = caches.lend("a", follow)
    assert again is drafter
    before = again.fed
    assert again.propose(3) == reference_greedy(draft, follow, 3, set())
    assert again.fed - before == len(b"\nnext") + 1 + 2  # the reply's last token was never fed; then 2 guesses
    # A second sequence of the same agent while the first runs gets its own; only `kept` idle ones stay.
    twin = caches.lend("a", HISTORY)
    assert twin is not again
    caches.give_back(twin)
    caches.give_back(again)
    caches.lend("b", HISTORY)
    assert len(caches) == 2  # b's (in use) and one idle


@pytest.fixture(autouse=True)
def small_draft_models(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny draft models are as large as the tiny served model and would never draft (allocate_drafts
    # prices a draft model's steps by its size): price them as models a twentieth of the size.
    monkeypatch.setattr(DraftCaches, "cost_share", lambda self, target: 0.05)


def engine_with_draft(draft_seed: int | None, speculate: str = "draft", batch: int = 8) -> Engine:
    """A tiny Llama served with a tiny Llama drafting for it (``draft_seed`` 0: the same weights)."""
    loaded = loaded_tiny("llama")
    if draft_seed is not None:
        loaded = replace(loaded, draft=DraftModel(f"tiny-draft-{draft_seed}", tiny_llama(seed=draft_seed)))
    engine = Engine(loaded, engine_settings(64 * 2**20, batch, 32, speculate=speculate, speculate_max_draft=6))
    engine.start()
    return engine


def prose(i: int) -> tuple[int, ...]:
    return (BOS, *(f"Agent {i} writes about the weather in town {i * 7}.".encode()))


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["same weights", "other weights"])
def test_greedy_tokens_equal_plain_decoding_alone_and_batched_with_a_draft_model(draft_seed: int) -> None:
    on, off = engine_with_draft(draft_seed), engine_with_draft(None, speculate="off")
    try:
        requests = [GenerationRequest(f"a{i}", prose(i), 40) for i in range(4)]
        mixed = run_turns(on, requests + [GenerationRequest("s", prose(9), 40, SamplingParams(temperature=0.5))])
        alone = run_turn(on, GenerationRequest("b0", requests[0].prompt_tokens, 40))
        plain = run_turns(off, [GenerationRequest(f"c{i}", r.prompt_tokens, 40) for i, r in enumerate(requests)])
        for m, p, r in zip(mixed, plain, requests):
            expected = reference_greedy(on.loaded.model, list(r.prompt_tokens), 40, {EOS})
            assert m.tokens == p.tokens == (expected[:-1] if expected[-1] == EOS else expected)
        assert alone.tokens == mixed[0].tokens
        assert on.fresh_snapshot().model.speculation == f"draft model tiny-draft-{draft_seed}"
        assert off.fresh_snapshot().model.speculation == "off"
        tallies = [m.finish.usage.speculation for m in [*mixed, alone]]
        assert all(t is not None and t.drafted > 0 for t in tallies)  # prose drafts too: a model guesses anywhere
        if draft_seed == 0:  # the served model's own weights: every greedy draft is kept
            greedy = tallies[:4] + tallies[5:]
            assert all(t.accepted == t.drafted for t in greedy), greedy
            assert sum(t.emitted for t in greedy) > 2 * sum(t.steps for t in greedy)
    finally:
        on.stop()
        off.stop()


def test_a_second_turn_drafts_from_the_agents_kept_draft_cache() -> None:
    engine = engine_with_draft(0)
    try:
        first = run_turn(engine, GenerationRequest("a", prose(1), 24))
        follow = (*first.request.prompt_tokens, *first.tokens, *b" And then?")
        second = run_turn(engine, GenerationRequest("a", follow, 24))
        assert second.tokens == reference_greedy(engine.loaded.model, list(follow), 24, {EOS})[:len(second.tokens)]
        caches = engine.call(lambda e: e.scheduler._batch.speculative.draft_caches).result()
        drafter = caches._by_owner["a"]
        # Fed: the first prompt, the reply's drafts, the follow-up's new tokens; never the first prompt again.
        assert len(first.request.prompt_tokens) < drafter.fed < len(first.request.prompt_tokens) + len(follow)
    finally:
        engine.stop()


def test_a_draft_model_that_numbers_tokens_differently_or_cannot_be_cut_back_is_refused() -> None:
    target = loaded_tiny("llama")

    class Shifted(ByteTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [t + 1 for t in super().encode(text, add_special_tokens)]

    with pytest.raises(ModelLoadError, match="'other' cannot draft for 'tiny-llama': they encode the same text"):
        check_draft_fits("other", tiny_llama(seed=1), Shifted(), target)
    with pytest.raises(ModelLoadError, match="'windowed' cannot draft: its layers' caches \\(RotatingKVCache\\)"):
        check_draft_fits("windowed", tiny_gemma3(seed=1), ByteTokenizer(), target)
    check_draft_fits("fits", tiny_llama(seed=1), ByteTokenizer(), target)


def test_naming_a_draft_model_turns_its_drafts_on_and_draft_without_one_names_the_field(tmp_path) -> None:
    assert Settings(cache_dir=tmp_path, draft_model="smollm2-135m").speculate == "draft"
    assert Settings(cache_dir=tmp_path, draft_model="smollm2-135m", speculate="lookup").speculate == "lookup"
    with pytest.raises(ValidationError, match="no draft_model is named: pass --draft-model"):
        Settings(cache_dir=tmp_path, speculate="draft")


def test_a_draft_model_as_large_as_the_served_one_is_never_asked_for_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # (priced by its real size)
    engine = engine_with_draft(0)
    try:
        assert engine.call(lambda e: e.scheduler._batch.speculative._draft_cost()).result() == pytest.approx(1.0)
        result = run_turn(engine, GenerationRequest("a", prose(1), 24))
        assert result.tokens == reference_greedy(engine.loaded.model, list(prose(1)), 24, {EOS})[:len(result.tokens)]
        tally = result.finish.usage.speculation
        assert tally is not None and tally.drafted == 0
        drafter = engine.call(lambda e: e.scheduler._batch.speculative.draft_caches._by_owner["a"]).result()
        assert drafter.fed == 0  # not one step of the draft model was spent
    finally:
        engine.stop()
