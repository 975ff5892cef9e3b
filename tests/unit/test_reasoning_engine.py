"""Thinking models in the real engine: tokens identical to mlx-lm with the same budget rule, split by route.

Tiny random-weight models of mlx-lm's own classes whose tokenizers have the
families' markers (tests/support/thinking_models.py). A random model rarely
writes an end marker itself, so a budget is what ends its reasoning: the
engine's tokens must equal plain mlx-lm greedy decoding with that rule
applied by a logits processor (tests/support/reference.reference_ruled),
whether the turn decodes pipelined, batched beside others, or speculating.
"""

from __future__ import annotations

import json

import pytest

from engine.domain.output_format import OutputFormat
from engine.domain.reasoning import ThinkFormat
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from tests.support.engine_settings import engine_settings
from tests.support.reference import reference_greedy, reference_ruled
from tests.support.thinking_models import loaded_thinking

pytestmark = pytest.mark.unit


def start(loaded, **batch) -> Engine:
    engine = Engine(loaded, engine_settings(64 * 2**20, 8, 32, **batch))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def qwen3():
    loaded = loaded_thinking("qwen3")
    engine = start(loaded)
    yield engine
    engine.stop()


def expected(engine: Engine, prompt: list[int], max_tokens: int, budget: int | None) -> list[int]:
    loaded = engine.loaded
    eos = set(loaded.eos_token_ids)
    tokens = reference_ruled(loaded.model, prompt, max_tokens, eos, loaded.reasoning, budget, loaded.tokenizer.decode)
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def prompt_of(engine: Engine, text: str) -> list[int]:
    return engine.loaded.tokenizer.encode(text)


def test_a_budget_ends_the_reasoning_exactly_and_the_split_follows_the_tokens(qwen3: Engine) -> None:
    tokenizer = qwen3.loaded.tokenizer
    end = tokenizer.special_ids["</think>"]
    prompt = prompt_of(qwen3, "<user>Say hi.\n<assistant><think>")
    result = run_turn(qwen3, GenerationRequest("q-budget", tuple(prompt), 40, reasoning_budget=12))
    tokens = expected(qwen3, prompt, 40, 12)
    assert end not in tokens[:12] and tokens[12] == end  # the rule wrote the end marker after exactly 12
    assert result.tokens == tokens
    assert result.finish.usage.reasoning_tokens == 12
    assert result.reasoning == tokenizer.decode(tokens[:12])
    assert result.text == tokenizer.decode(tokens[13:])
    assert "</think>" not in result.text + result.reasoning


def test_batched_turns_keep_their_own_budgets_and_an_unbudgeted_one_is_plain_greedy(qwen3: Engine) -> None:
    prompts = [prompt_of(qwen3, f"<user>Agent {i} asks.\n<assistant><think>") for i in range(3)]
    budgets = [3, 17, None]
    results = run_turns(qwen3, [GenerationRequest(f"q-batch-{i}", tuple(p), 30, reasoning_budget=b)
                                for i, (p, b) in enumerate(zip(prompts, budgets))])
    for result, prompt, budget in zip(results, prompts, budgets):
        assert result.tokens == expected(qwen3, prompt, 30, budget)
    eos = set(qwen3.loaded.eos_token_ids)
    plain = reference_greedy(qwen3.loaded.model, prompts[2], 30, eos)
    assert results[2].tokens == [t for t in plain if t not in eos]
    assert results[2].text == "" and results[2].finish.usage.reasoning_tokens == len(results[2].tokens)


def test_speculating_turns_hold_the_budget_as_pipelined_ones_do() -> None:
    loaded = loaded_thinking("qwen3")
    engine = start(loaded, speculate="lookup", speculate_max_draft=6)
    try:
        # A prompt that repeats itself: drafts are found, the batch speculates.
        prompt = prompt_of(engine, "<user>" + "abc abc abc abc " * 6 + "\n<assistant><think>abc abc abc ")
        result = run_turn(engine, GenerationRequest("spec", tuple(prompt), 48, reasoning_budget=20))
        assert result.tokens == expected(engine, prompt, 48, 20)
        assert result.finish.usage.reasoning_tokens == 20
        speculation = result.finish.usage.speculation
        assert speculation is not None and speculation.steps > 0  # it did verify drafts
    finally:
        engine.stop()


def test_a_schema_constrains_the_answer_only_after_the_reasoning(qwen3: Engine) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    prompt = prompt_of(qwen3, "<user>JSON please.\n<assistant><think>")
    request = GenerationRequest("q-json", tuple(prompt), 60, reasoning_budget=8,
                                output_format=OutputFormat.from_schema(schema))
    result = run_turn(qwen3, request)
    free = expected(qwen3, prompt, 9, 8)
    assert result.tokens[:9] == free[:9]  # the reasoning is the model's own, unconstrained
    assert json.loads(result.text) in ({"ok": True}, {"ok": False})
    assert result.finish.reason.value == "complete" and result.finish.reason.outcome == "stop"


def test_harmony_analysis_budget_writes_a_new_header_that_cannot_be_analysis() -> None:
    loaded = loaded_thinking("gpt_oss")
    engine = start(loaded)
    try:
        tokenizer = loaded.tokenizer
        prompt = prompt_of(engine, "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>")
        result = run_turn(engine, GenerationRequest("oss", tuple(prompt), 30, reasoning_budget=6))
        tokens = expected(engine, prompt, 30, 6)
        assert result.tokens == tokens
        header = 3 + len(loaded.reasoning.assistant)  # <|end|><|start|>, the role's tokens, <|channel|>
        assert tokenizer.decode(tokens[6:6 + header]) == "<|end|><|start|>assistant<|channel|>"
        assert tokens[6 + header] != loaded.reasoning.analysis[0]
        assert result.reasoning == tokenizer.decode(tokens[:6]) and result.finish.usage.reasoning_tokens == 6
        assert "<|" not in result.text + result.reasoning
    finally:
        engine.stop()


def test_gemma4_channel_markers_of_several_tokens() -> None:
    """Gemma 4 opens its reasoning with ``<|channel>thought`` (here the marker token and seven bytes)."""
    from tests.support.thinking_models import thinking_tokenizer

    tokenizer = thinking_tokenizer("gemma4_text")
    fmt = ThinkFormat(tuple(tokenizer.encode("<|channel>thought", add_special_tokens=False)),
                      (tokenizer.special_ids["<channel|>"],), "<|channel>thought", "<channel|>")
    loaded = loaded_thinking("gemma4_text", reasoning=fmt)
    engine = start(loaded)
    try:
        prompt = prompt_of(engine, "<user>Hi\n<assistant><|channel>thought\n")
        result = run_turn(engine, GenerationRequest("g4", tuple(prompt), 24, reasoning_budget=5))
        tokens = expected(engine, prompt, 24, 5)
        assert result.tokens == tokens and tokens[5] == fmt.end[0]
        assert result.reasoning == tokenizer.decode(tokens[:5])
        assert "<channel|>" not in result.text
    finally:
        engine.stop()


def test_a_hybrid_resumes_where_the_reply_began_when_the_template_drops_its_reasoning() -> None:
    """The next prompt renders the reply without its reasoning (Qwen's templates, after a new question): it
    diverges at the generation prompt's ``<think>``. The turn's snapshot was taken there (``reply_start``), so the
    recurrent state resumes from it; one short of the prompt's end would have been past the divergence."""
    loaded = loaded_thinking("qwen3_5")
    engine = start(loaded)
    try:
        tokenizer = loaded.tokenizer
        head = "<user>" + "Tell me a story about a cat. " * 3 + "\n<assistant>"
        first_prompt = prompt_of(engine, head + "<think>")
        opened = len(first_prompt) - 1
        first = run_turn(engine, GenerationRequest("hy", tuple(first_prompt), 12, reasoning_budget=4,
                                                   reply_start=opened))
        assert first.finish.usage.reasoning_tokens == 4
        second_prompt = prompt_of(engine, head + first.text + "\n<user>And a dog?\n<assistant><think>")
        assert second_prompt[:opened] == first_prompt[:opened] and second_prompt[opened] != first_prompt[opened]
        second = run_turn(engine, GenerationRequest("hy", tuple(second_prompt), 8, reasoning_budget=4,
                                                    reply_start=len(second_prompt) - 1))
        assert second.finish.usage.reused_tokens == opened
        assert second.tokens == expected(engine, second_prompt, 8, 4)  # what a fresh prefill gives
    finally:
        engine.stop()
