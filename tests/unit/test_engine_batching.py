"""The engine on tiny random-weight models: batching, reuse, trimming, cancellation."""

from __future__ import annotations

import pytest
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.engine_seams import EngineSeams
from tests.support.engine_settings import engine_settings
from engine.domain.requests import FinishReason, GenerationRequest, SamplingParams
from tests.support.byte_tokenizer import BOS, EOS
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from tests.support.prefill_passes import record_prefill_passes
from tests.support.reference import reference_greedy
from tests.support.tiny_models import loaded_tiny


def make_engine(
    kind: str = "llama", budget_mb: float = 64, batch: int = 8, prefill_step: int = 32,
    blocks: int | None = None, prefix_sharing: bool = True, backend=None, **kw,
) -> Engine:
    """A started engine on a tiny model; ``blocks`` sizes the pool in blocks instead of MiB; ``backend``: the
    compute backend (default: chosen for this device)."""
    loaded = loaded_tiny(kind, **kw)
    budget = blocks * loaded.spec.block_bytes if blocks else int(budget_mb * 2**20)
    config = engine_settings(budget, batch, prefill_step, prefix_sharing=prefix_sharing)
    engine = Engine(loaded, config, seams=EngineSeams(backend=backend))
    engine.start()
    return engine


@pytest.fixture(params=["llama", "gemma"])
def engine(request):
    eng = make_engine(request.param)
    yield eng
    eng.stop()


def prompt_for(i: int, repeat: int = 1) -> tuple[int, ...]:
    return (BOS, *(f"agent {i} says hello. " * (repeat + i)).encode())


def without_eos(tokens: list[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] == EOS else tokens


@pytest.mark.parametrize("n_agents", [1, 3, 8])
def test_batched_greedy_matches_single_stream(engine: Engine, n_agents: int) -> None:
    requests = [GenerationRequest(f"agent-{i}", prompt_for(i), 24) for i in range(n_agents)]
    results = run_turns(engine, requests)
    for result in results:
        expected = reference_greedy(engine.loaded.model, list(result.request.prompt_tokens), 24, {EOS})
        assert result.tokens == without_eos(expected)
        assert result.finish.usage.generated_tokens == len(expected)


def test_second_turn_reuses_prefix_and_matches_fresh_prefill(engine: Engine) -> None:
    first = run_turn(engine, GenerationRequest("a", prompt_for(0, 3), 16))
    follow_up = first.request.prompt_tokens + tuple(first.tokens) + tuple(b" and then?")
    second = run_turn(engine, GenerationRequest("a", follow_up, 16))
    usage = second.finish.usage
    cached = len(first.request.prompt_tokens) + first.finish.usage.generated_tokens
    assert usage.reused_tokens == min(cached, len(follow_up) - 1)
    assert usage.reused_tokens + usage.prefilled_tokens == usage.prompt_tokens
    assert usage.reuse_source == "self"
    expected = reference_greedy(engine.loaded.model, list(follow_up), 16, {EOS})
    assert second.tokens == without_eos(expected)


def test_divergent_history_trims_to_common_prefix() -> None:
    engine = make_engine("llama")
    try:
        first = run_turn(engine, GenerationRequest("a", prompt_for(0, 4), 8))
        edited = first.request.prompt_tokens[:40] + tuple(b"something else entirely")
        second = run_turn(engine, GenerationRequest("a", edited, 8))
        assert second.finish.usage.reused_tokens == 40
        assert second.tokens == without_eos(reference_greedy(engine.loaded.model, list(edited), 8, {EOS}))
        agent = engine.fresh_snapshot().agent("a")
        assert agent is not None and agent.cached_tokens == len(edited) + second.finish.usage.generated_tokens
    finally:
        engine.stop()


def test_sliding_window_cache_past_window_falls_back_to_full_prefill() -> None:
    engine = make_engine("gemma")  # window 24
    try:
        first = run_turn(engine, GenerationRequest("g", prompt_for(0, 3), 8))
        assert len(first.request.prompt_tokens) > 24
        edited = first.request.prompt_tokens[:10] + tuple(b"divergent tail here")
        second = run_turn(engine, GenerationRequest("g", edited, 8))
        usage = second.finish.usage
        assert usage.reused_tokens == 0
        assert usage.reuse_note is not None and "sliding-window" in usage.reuse_note
        assert second.tokens == without_eos(reference_greedy(engine.loaded.model, list(edited), 8, {EOS}))
    finally:
        engine.stop()


def test_sliding_window_cache_within_window_can_be_trimmed() -> None:
    engine = make_engine("gemma")
    try:
        short = (BOS, *b"hi there")
        first = run_turn(engine, GenerationRequest("g", short, 4))
        edited = short[:5] + tuple(b"XYZ")
        second = run_turn(engine, GenerationRequest("g", edited, 6))
        assert second.finish.usage.reused_tokens == 5
        assert second.tokens == without_eos(reference_greedy(engine.loaded.model, list(edited), 6, {EOS}))
        assert first.finish.reason in (FinishReason.LENGTH, FinishReason.STOP)
    finally:
        engine.stop()


def test_seeded_sampling_is_independent_of_batch_company(engine: Engine) -> None:
    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234)
    alone = run_turn(engine, GenerationRequest("s1", prompt_for(1), 16, sampling))
    company = [GenerationRequest(f"s{i}", prompt_for(i), 16, SamplingParams(0.8, seed=i)) for i in range(2, 5)]
    together = run_turns(engine, [GenerationRequest("s9", prompt_for(1), 16, sampling), *company])
    assert together[0].tokens == alone.tokens


def test_max_tokens_is_clamped_to_context() -> None:
    engine = make_engine("llama", context=64)
    try:
        prompt = prompt_for(0)
        accepted = engine.validate(GenerationRequest("c", prompt, 10_000))
        assert accepted.max_tokens == 64 - len(prompt)
    finally:
        engine.stop()


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.7, seed=-5),
    SamplingParams(temperature=0.7, seed=2**70),
    SamplingParams(temperature=0.7, top_k=10**6),
    SamplingParams(temperature=0.7),
])
def test_unusual_sampling_values_never_break_the_batch(sampling: SamplingParams) -> None:
    engine = make_engine("llama")
    try:
        results = run_turns(engine, [GenerationRequest("odd", prompt_for(0), 6, sampling),
                                     GenerationRequest("plain", prompt_for(1), 6)])
        assert all(r.finish.error is None and r.finish.usage.generated_tokens >= 1 for r in results)
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_equal_length_prompts_are_prefilled_together_and_match_single_stream(
    kind: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four 70-token prompts: their 32-token chunks (and the 6-token tails) go through the model
    as one batch per step, each row writing its own cache; greedy output equals single-stream."""
    passes = record_prefill_passes(monkeypatch)
    engine = make_engine(kind, prefill_step=128)  # 128 tokens a step: 4 rows of 32
    model = engine.loaded.model
    try:
        prompts = [(BOS, *(f"agent {i} asks about topic {i * 7}. " * 6).encode()[:69]) for i in range(4)]
        assert len({len(p) for p in prompts}) == 1
        results = run_turns(engine, [GenerationRequest(f"together-{i}", p, 12) for i, p in enumerate(prompts)])
    finally:
        engine.stop()
    groups = [(len(sizes), n) for sizes, n in passes]
    assert any(size > 1 for size, _ in groups), groups
    assert all(size * n <= 128 for size, n in groups)
    for result, prompt in zip(results, prompts):
        assert result.tokens == without_eos(reference_greedy(model, list(prompt), 12, {EOS}))


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_prompts_of_different_lengths_are_padded_into_one_pass_where_the_model_allows(
    kind: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four prompts of 61-70 tokens arriving together: on a model without sliding-window layers the
    shorter ones join the longest's pass padded (filler K/V trimmed away after it); with window
    layers only equal chunks group. Greedy output equals single-stream either way, and every cache
    holds exactly its prompt and answer afterwards."""
    from engine.runtime.runner.batch import PAD_SLACK

    groups = record_prefill_passes(monkeypatch)
    engine = make_engine(kind, prefill_step=512)
    model = engine.loaded.model
    try:
        prompts = [(BOS, *(f"agent {i} asks about topic {i * 7}. " * 6).encode()[:60 + 3 * i]) for i in range(4)]
        assert len({len(p) for p in prompts}) == 4
        requests = [GenerationRequest(f"ragged-{kind}-{i}", p, 12) for i, p in enumerate(prompts)]
        results = run_turns(engine, requests)
        held = engine.call(lambda e: [(len(e.agents.get(r.agent_id).tokens), e.agents.get(r.agent_id).kv.offset)
                                      for r in requests]).result()
    finally:
        engine.stop()
    padded = [(sizes, n) for sizes, n in groups if len(sizes) > 1 and min(sizes) < n]
    if kind == "llama":
        assert padded, groups
        assert all(n - m <= max(n // 4, PAD_SLACK) for sizes, n in padded for m in sizes), padded
    else:
        assert not padded, groups
    for result, prompt in zip(results, prompts):
        assert result.tokens == without_eos(reference_greedy(model, list(prompt), 12, {EOS}))
    assert all(tokens == offset for tokens, offset in held), held


def test_a_row_without_room_for_its_filler_waits_for_a_later_pass_instead_of_failing() -> None:
    """The batch asks room for a padded row's filler separately: refused, the row leaves the padded
    pass and is prefilled unpadded in a later one; nobody runs out of room over filler."""
    from engine.runtime.runner.batch import SequenceBatch
    from engine.runtime.runner.sequence import Phase, Sequence
    from engine.runtime.runner.kv.sequence_kv import SequenceKV
    from engine.runtime.runner.step_output import StepOutput

    loaded = loaded_tiny("llama")
    tight = 1  # this sequence's cache may hold its prompt, never more

    def step() -> StepOutput:
        """Plan, grant (the tight sequence never past its prompt), run: the scheduler's part, by hand."""
        plan = batch.plan()
        room = {}
        for ask in plan.asks:
            for n_tokens in ask.levels:
                if ask.sequence.uid == tight and n_tokens > len(ask.sequence.prompt):
                    break
                ask.sequence.kv.reserve(n_tokens)
                room[ask.sequence.uid] = n_tokens
        return batch.step(plan, room)

    batch = SequenceBatch(loaded.model, 512, 8)
    prompts = [[BOS, *b"a longer prompt that sets the width of the pass"], [BOS, *b"a shorter prompt here"]]
    sequences = [Sequence(uid, SequenceKV.empty(loaded.spec), p, 4) for uid, p in enumerate(prompts)]
    for sequence in sequences:
        batch.insert(sequence)
    first = step()
    assert [p.uid for p in first.prefill] == [0] and not first.out_of_room
    assert sequences[tight].phase is Phase.PREFILL
    second = step()
    assert [p.uid for p in second.prefill] == [tight] and not second.out_of_room
    assert sequences[tight].prompt_fed == len(prompts[tight]) - 1  # its whole chunk, unpadded
