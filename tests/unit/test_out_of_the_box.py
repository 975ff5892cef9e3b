"""Defaults a client that sets nothing relies on: model sampling defaults, the output cap, the loop guard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models.sampling_defaults import FALLBACK, packaged_card_defaults, read_sampling_defaults
from engine.domain.repetition import MAX_PERIOD, SIMILARITY, Loop, RepetitionGuard
from engine.domain.requests import FinishReason, GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from tests.unit.test_engine_batching import make_engine, prompt_for

pytestmark = pytest.mark.unit


# -- sampling defaults ----------------------------------------------------------------------------
def write_config(folder: Path, config: object) -> Path:
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_a_folder_without_generation_config_uses_the_documented_fallback(tmp_path: Path) -> None:
    defaults = read_sampling_defaults(tmp_path)
    assert defaults == FALLBACK and (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.95, 40)
    assert "fallback" in defaults.describe()


def test_generation_config_values_are_the_defaults(tmp_path: Path) -> None:
    defaults = read_sampling_defaults(write_config(tmp_path, {"do_sample": True, "temperature": 0.2, "top_p": 0.9}))
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.2, 0.9, 0)
    assert defaults.source == "generation_config.json"


def test_do_sample_false_means_greedy(tmp_path: Path) -> None:
    defaults = read_sampling_defaults(write_config(tmp_path, {"do_sample": False, "temperature": 0.6}))
    assert defaults.temperature == 0 and defaults.params().is_greedy


@pytest.mark.parametrize("config", ["not json", [1, 2], {"bos_token_id": 1}, {"temperature": "hot"}])
def test_unusable_generation_config_falls_back(tmp_path: Path, config: object) -> None:
    if config == "not json":
        (tmp_path / "generation_config.json").write_text("{")
    else:
        write_config(tmp_path, config)
    defaults = read_sampling_defaults(tmp_path)
    assert defaults.temperature == FALLBACK.temperature


def test_settings_override_one_value_at_a_time(tmp_path: Path) -> None:
    defaults = read_sampling_defaults(tmp_path).with_overrides(0.3, None, None)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.3, 0.95, 40)
    assert "overridden by settings" in defaults.source


def test_a_packaged_gguf_without_generation_config_samples_as_its_model_card_says(tmp_path: Path) -> None:
    card = packaged_card_defaults("smollm2-135m")
    assert card is not None and (card.temperature, card.top_p, card.top_k) == (0.2, 0.9, 0)
    assert read_sampling_defaults(tmp_path, card) == card and "model card" in card.describe()
    # Found by the import's source GGUF when the folder is passed by path.
    (tmp_path / "semantic_import.json").write_text(json.dumps({"source_path": "/x/SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert packaged_card_defaults(str(tmp_path), tmp_path) == card
    # A generation_config.json in the folder still wins; unknown models keep the generic fallback.
    write_config(tmp_path, {"temperature": 0.6, "top_p": 0.8})
    assert read_sampling_defaults(tmp_path, card).temperature == 0.6
    assert packaged_card_defaults("some/other-model") is None and packaged_card_defaults("gemma3-270m") is None


# -- repetition guard -----------------------------------------------------------------------------
def feed(guard: RepetitionGuard, tokens: list[int]) -> int | None:
    """Index of the token at which the guard fires, or None."""
    return next((i for i, t in enumerate(tokens) if guard.push(t) is not None), None)


def test_a_single_token_loop_ends_after_half_a_window_of_exact_repetition() -> None:
    assert feed(RepetitionGuard(128), [7, 8, 9] + [5] * 100) == 3 + 63


def test_a_repeated_sentence_ends_after_half_a_window() -> None:
    sentence = list(range(100, 112))  # 12 tokens
    tokens = [1, 2, 3] + sentence * 30
    at = feed(RepetitionGuard(192), tokens)
    assert at == 3 + 95
    loop = RepetitionGuard(192)
    found = [loop.push(t) for t in tokens[: at + 1]][-1]
    assert found is not None and found.exact and found.period == 12 and found.span == 96


def numbered_list(lines: int, changing: int) -> list[int]:
    """A sampled small model's runaway: one 12-token sentence under a heading whose last ``changing`` tokens count."""
    out = [1, 2, 3]
    for k in range(lines):
        out += [50, 51][: 2 - changing] + [600 + (k + j) % 97 for j in range(changing)] + list(range(100, 111))
    return out


def test_a_numbered_list_of_one_sentence_ends_as_a_near_loop() -> None:
    tokens = numbered_list(100, changing=1)  # 13-token lines, 12 of 13 tokens equal a line back: 92%
    assert feed(RepetitionGuard(0), tokens) is None
    guard = RepetitionGuard(256)
    at = feed(guard, tokens)
    # No exact cycle (the counter moves), so it ends only once a whole window is 90% repetition.
    assert at is not None and 256 + 13 - 1 <= at < 256 + 3 * 13
    found = [g.push(t) for g in [RepetitionGuard(256)] for t in tokens[: at + 1]][-1]
    assert found is not None and not found.exact and found.period == 13 and found.span == 256
    assert "small changes" in found.describe()


def test_lines_that_change_more_than_a_tenth_are_left_alone() -> None:
    # Two counting tokens in 13: 85% equal a line back, below the 90% a near loop needs.
    assert feed(RepetitionGuard(256), numbered_list(200, changing=2)) is None


def test_ordinary_text_and_a_disabled_guard_never_fire() -> None:
    varied = [(i * 7919) % 1000 for i in range(2000)]
    assert feed(RepetitionGuard(128), varied) is None
    assert feed(RepetitionGuard(0), [5] * 1000) is None
    # A cycle longer than the guard looks at (MAX_PERIOD) is not taken for a loop.
    long_cycle = list(range(200, 200 + MAX_PERIOD + 16)) * 20
    assert feed(RepetitionGuard(256), long_cycle) is None


def test_a_65_token_cycle_ends_as_an_exact_loop() -> None:
    """Gemma 3 270M's loop on Codex CLI's prompt: five XML-like lines, 65 tokens, repeated to the cap."""
    cycle = list(range(300, 365))
    guard = RepetitionGuard(512)
    found = next(loop for loop in (guard.push(t) for t in [7, 8, 9] + cycle * 10) if loop is not None)
    assert found.exact and found.period == 65 and found.span == 256  # half the window: the exact rule


@given(st.lists(st.integers(0, 40), min_size=0, max_size=900), st.integers(16, 300))
def test_the_window_counts_equal_a_recount_from_scratch(tokens: list[int], window: int) -> None:
    """The guard's running counts are what recounting the window from the tokens gives, token after token."""
    guard = RepetitionGuard(window)
    for n, token in enumerate(tokens, start=1):
        guard.push(token)
        for period in (1, 7, 64):
            if n > period:
                first = max(n - window, period)
                expected = sum(tokens[i] == tokens[i - period] for i in range(first, n))
                assert guard._matches[period] == expected


def _reference_loop(tokens: list[int], window: int) -> tuple[int, Loop] | None:
    """The rules as first written: every period checked at every token, runs and counts recounted."""
    exact_window = max(window // 2, 2)
    for n in range(2, len(tokens) + 1):
        for period in range(1, min(MAX_PERIOD, n - 1) + 1):
            run = 0
            while run < n - period and tokens[n - 1 - run] == tokens[n - 1 - run - period]:
                run += 1
            if run >= max(exact_window - period, 2 * period):
                return n - 1, Loop(period, run + period)
            first = max(n - window, period)
            if n >= window + period and sum(tokens[i] == tokens[i - period] for i in range(first, n)) >= SIMILARITY * window:
                return n - 1, Loop(period, window, exact=False)
    return None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=0, max_size=400), st.integers(8, 120), st.integers(0, 5))
def test_the_guard_finds_what_checking_every_period_finds(noise: list[int], window: int, seed: int) -> None:
    """The guard skips the periods a token cannot change; it must end a response exactly where, and as,
    checking every period at every token would (loops of a few periods, with noise between them)."""
    cycle = [100 + (seed * 7 + k) % 13 for k in range(seed + 2)]
    tokens = noise[: len(noise) // 2] + cycle * (3 + seed) + noise[len(noise) // 2:]
    guard = RepetitionGuard(window)
    found = next(((at, loop) for at, loop in enumerate(guard.push(t) for t in tokens) if loop is not None), None)
    assert found == _reference_loop(tokens, window)


def test_the_engine_ends_a_looping_generation_and_says_why() -> None:
    engine = make_engine("llama")  # tiny random llama: greedy output is one token repeated
    try:
        result = run_turn(engine, GenerationRequest("looper", prompt_for(0), 2000))
        assert result.finish.reason is FinishReason.REPETITION
        assert result.finish.usage.generated_tokens == 256  # half the default window: an exact loop
        assert "repetition guard" in (result.finish.note or "")
        agent = engine.fresh_snapshot().agent("looper")
        assert agent.last_finish == "repetition" and "cycle of 1 token" in (agent.last_finish_note or "")
        # The cache holds everything generated: the next turn continues from it.
        follow = prompt_for(0) + tuple(result.tokens) + tuple(b" go on")
        nxt = run_turn(engine, GenerationRequest("looper", follow, 4))
        assert nxt.finish.usage.reused_tokens == len(prompt_for(0)) + 256
    finally:
        engine.stop()


# -- through the HTTP API -------------------------------------------------------------------------
@pytest.fixture
def engine():
    from tests.support.scripted_engine import ScriptedEngine

    return ScriptedEngine()


def anthropic(**fields):
    return {"model": "claude-opus-5-5", "max_tokens": 200, "messages": [{"role": "user", "content": "Hi"}], **fields}


async def test_a_request_without_temperature_samples_with_the_model_defaults(client, engine) -> None:
    await client.post("/v1/messages", json=anthropic())
    await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    for request in engine.requests:
        assert (request.sampling.temperature, request.sampling.top_p, request.sampling.top_k) == (0.7, 0.95, 40)


async def test_explicit_values_win_one_at_a_time(client, engine) -> None:
    await client.post("/v1/messages", json=anthropic(temperature=0))
    await client.post("/v1/messages", json=anthropic(temperature=0.3, top_k=5))
    await client.post("/v1/messages", json=anthropic(top_p=0))  # Anthropic's top_p 0: only the top token
    greedy, chosen, top_p_zero = engine.requests
    assert greedy.sampling.is_greedy and top_p_zero.sampling.is_greedy
    assert (chosen.sampling.temperature, chosen.sampling.top_p, chosen.sampling.top_k) == (0.3, 0.95, 5)


async def test_max_tokens_beyond_the_output_cap_is_clamped_and_reported(client, engine, service) -> None:
    cap = service.settings.max_output_tokens
    for _ in range(2):
        response = await client.post("/v1/messages", json=anthropic(max_tokens=32000, stream=True))
        assert response.status_code == 200
        granted, asked, setting = response.headers["x-semantic-max-tokens"].split("; ")
        # The cap, or less where the context leaves less room after the prompt.
        assert 0 < int(granted) <= cap and asked == "asked=32000" and setting == "setting=max_output_tokens"
    assert all(r.max_tokens <= cap and r.asked_max_tokens == 32000 for r in engine.requests)
    said = [e for e in service.events.since(0) if "clamped" in e.message]
    assert len(said) == 1  # once per agent, not every turn
    small = await client.post("/v1/messages", json=anthropic(max_tokens=100))
    assert "x-semantic-max-tokens" not in small.headers
