"""Speculative decoding on the real packaged models: greedy tokens equal plain decoding's, alone and batched."""

from __future__ import annotations

import pytest

from engine.domain.requests import GenerationRequest, SamplingParams
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from tests.model.engine_fixtures import start_engine
from tests.support.reference import reference_greedy

MAX_TOKENS = 64
# The mixed batch's replies: two engines decode five and four rows of them (Gemma 3: 64 tokens took 52-64 s
# here); the copy row's reference is the one the alone test computed, cut.
MIXED_TOKENS = 40
# Text a model asked to repeat copies: its drafts come from the prompt.
VERSE = ("def area(width, height):\n    return width * height\n\n"
         "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
         "def describe(width, height):\n    return f'{width} by {height}: area {area(width, height)}'\n")


def prompts(loaded) -> list[tuple[int, ...]]:
    """A copy request, and prompts with nothing to copy."""
    if loaded.architecture == "llama":
        texts = [f"Repeat this code exactly:\n\n{VERSE}", "What is the capital of France?",
                 "Name three primary colours.", f"Rename area to surface in this code:\n\n{VERSE}"]
        return [tuple(loaded.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
                for t in texts]
    texts = [f"{VERSE}\n# The same code again:\n", "The capital of France is", "Once upon a time,",
             f"{VERSE}\n# Again, with area renamed to surface:\n"]
    return [tuple(loaded.tokenizer.encode(t)) for t in texts]


def without_eos(loaded, tokens: list[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in set(loaded.eos_token_ids) else tokens


@pytest.fixture(params=["smollm2", "gemma3"], scope="module")
def loaded(request):
    return request.getfixturevalue(request.param)


def test_speculation_alone_keeps_greedy_tokens_and_drafts_from_the_prompt(loaded) -> None:
    # A fresh engine: the batch's step rates (step_rates.py) start fresh, so whether the copy drafts does not hang
    # on how earlier speculative steps happened to time on a busy machine.
    on = start_engine(loaded, budget_mb=256)
    try:
        copy_prompt = prompts(loaded)[0]
        alone = run_turn(on, GenerationRequest("alone", copy_prompt, MAX_TOKENS))
        assert alone.tokens == expected_copy(loaded), loaded.tokenizer.decode(alone.tokens)
        copy = alone.finish.usage.speculation
        assert copy is not None and copy.accepted > 0 and copy.tokens_per_step > 1, copy
        # The cache holds exactly the prompt and every token of the answer.
        held = on.call(lambda e: (len(e.agents.get("alone").tokens), e.agents.get("alone").kv.offset)).result()
        assert held == (len(copy_prompt) + alone.finish.usage.generated_tokens,) * 2
        view = on.fresh_snapshot()
        assert view.throughput.speculation.drafted >= copy.drafted
    finally:
        on.stop()


def test_speculation_in_a_mixed_batch_keeps_every_rows_greedy_tokens(loaded) -> None:
    on, off = start_engine(loaded, budget_mb=256), start_engine(loaded, budget_mb=256, speculate="off")
    try:
        chosen = prompts(loaded)
        batched = run_turns(on, [GenerationRequest(f"mixed-{i}", p, MIXED_TOKENS) for i, p in enumerate(chosen)]
                            + [GenerationRequest("sampled", chosen[1], MIXED_TOKENS, SamplingParams(temperature=0.7))])
        plain = run_turns(off, [GenerationRequest(f"plain-{i}", p, MIXED_TOKENS) for i, p in enumerate(chosen)])
        assert batched[0].tokens == plain[0].tokens == expected_copy(loaded, MIXED_TOKENS), \
            loaded.tokenizer.decode(batched[0].tokens)
        for i in range(1, len(chosen)):
            assert batched[i].tokens == plain[i].tokens, (i, loaded.tokenizer.decode(batched[i].tokens))
        assert batched[-1].finish.usage.speculation is not None  # the sampled row could speculate too
    finally:
        on.stop()
        off.stop()


def expected_copy(loaded, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Plain mlx-lm's greedy answer to the copy request."""
    return without_eos(loaded, reference_greedy(loaded.model, list(prompts(loaded)[0]), max_tokens,
                                                set(loaded.eos_token_ids)))


def test_a_draft_model_named_in_the_settings_drafts_for_smollm2_and_keeps_its_greedy_tokens(
        smollm2, smollm2_path, gemma3, model_cache_dir, monkeypatch) -> None:
    """SmolLM2 drafting for itself, loaded the way ``--draft-model`` loads it: the tokenizer check passes, the
    tokens are plain decoding's, and nearly every greedy draft is kept (the served model runs this CPU's fast
    path, the draft plain mlx-lm: an argmax may differ between them now and then). As large as the served
    model, it would never be asked for drafts; it is priced here as the small model it stands in for."""
    from engine.bootstrap import with_draft_model
    from engine.errors import ModelLoadError
    from engine.models.draft_model import check_draft_fits
    from engine.runtime.runner.model_drafting import DraftCaches
    from engine.settings import Settings

    monkeypatch.setattr(DraftCaches, "cost_share", lambda self, target: 0.05)

    settings = Settings(model=str(smollm2_path), draft_model=str(smollm2_path), cache_dir=model_cache_dir)
    loaded = with_draft_model(settings, smollm2)
    assert loaded.draft is not None and settings.speculate == "draft"
    with pytest.raises(ModelLoadError, match="their vocabularies differ"):
        check_draft_fits(gemma3.model_id, gemma3.model, gemma3.tokenizer, smollm2)
    engine = start_engine(loaded, budget_mb=256, speculate="draft")
    try:
        chosen = prompts(smollm2)[1:3]
        results = run_turns(engine, [GenerationRequest(f"d{i}", p, 32) for i, p in enumerate(chosen)])
        for prompt, result in zip(chosen, results):
            expected = reference_greedy(smollm2.model, list(prompt), 32, set(smollm2.eos_token_ids))
            assert result.tokens == without_eos(smollm2, expected), smollm2.tokenizer.decode(result.tokens)
            tally = result.finish.usage.speculation
            assert tally is not None and tally.accepted >= 0.9 * tally.drafted > 0, tally
            assert tally.tokens_per_step > 2, tally
    finally:
        engine.stop()


def test_a_draft_model_that_does_not_fit_is_refused_at_start_and_left_out_of_a_swap(
        smollm2_path, gemma3_path, model_cache_dir) -> None:
    """Named for Gemma 3 (another tokenizer), SmolLM2 stops the start with the reason; a swap from SmolLM2 to
    Gemma 3 loads Gemma 3 without it (its agents draft by lookup)."""
    from engine.bootstrap import load_configured_model
    from engine.errors import ModelLoadError
    from engine.settings import Settings

    with pytest.raises(ModelLoadError, match="cannot draft for .*their vocabularies differ.*--draft-model"):
        load_configured_model(Settings(model=str(gemma3_path), draft_model=str(smollm2_path),
                                       cache_dir=model_cache_dir))
    settings = Settings(model=str(smollm2_path), draft_model=str(smollm2_path), cache_dir=model_cache_dir)
    swapped = load_configured_model(settings, ref=str(gemma3_path))
    assert swapped.architecture == "gemma3_text" and swapped.draft is None
    from engine.models.draft_model import speculation_mode

    assert speculation_mode(settings.speculate, swapped) == "lookup (the draft model does not fit this model)"
