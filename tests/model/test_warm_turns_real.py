"""Warm turns on the real models: 14 turns whose replies come back re-rendered.

A client sends the assistant's reply back as text, rendered again through
the chat template (or the plain rendering of a template-less model), so the
next prompt can diverge inside the previous reply. The checked turns must produce
the tokens a fresh prefill of the same prompt produces; on Gemma 3 every
turn must reuse at least everything up to the previous turn's prompt end but
its last token (the window layers resume from the checkpoint kept there); the pool must count exactly
the arrays alive after every turn; and a trip through the disk tier in the
middle of the conversation changes nothing.
"""

from __future__ import annotations

import pytest

from engine.domain.chat import ChatMessage, Conversation
from engine.formats.rendering import PromptRenderer
from engine.runtime.tiers.accounting import held_bytes
from engine.runtime.tiers.agents import Tier
from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.model.engine_fixtures import start_engine
from tests.support.reference import reference_greedy

TURNS = 14
REPLY_TOKENS = 8
EVICT_AT = 9  # the turn before which the agent goes to disk and comes back
# The turns compared with a fresh prefill of the whole conversation (the reference's prefill is most
# of this test's time): the first, the first turn after a reply whose text changed (turn % 3 == 0 rewrites
# it), the one after the second rewrite into the sliding window's second half, the turn restored from disk
# and the last. A cache that drifted on an unchecked turn stays drifted: the next checked turn, and the last,
# still see it.
CHECKED = {0, 4, 7, EVICT_AT, TURNS - 1}


def system_text(words: int) -> str:
    facts = " ".join(f"Fact {i}: station {i} reports {(i * 37) % 100} degrees." for i in range(words // 7))
    return f"You are a weather assistant. Use these readings.\n{facts}"


def question(turn: int) -> str:
    return f"Question {turn}: what does station {turn * 3} report, in one short sentence?"


def rerendered(reply: str, turn: int) -> str:
    # Clients strip, re-wrap or re-encode replies; every third turn the text itself changes a little.
    return reply.strip() + (" (noted)" if turn % 3 == 0 else "")


def without_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


@pytest.mark.slow(reason="fourteen turns on the real model and five fresh-prefill references (Gemma 3: ~35 s here)")
@pytest.mark.parametrize("model, system_words", [("smollm2", 120), ("gemma3", 420)])
def test_rerendered_turns_equal_fresh_prefill(model: str, system_words: int, request, tmp_path) -> None:
    loaded = request.getfixturevalue(model)
    eos = set(loaded.eos_token_ids)
    renderer = PromptRenderer(loaded.tokenizer)
    engine = start_engine(loaded, budget_mb=256, store=WarmStore(tmp_path, stored_model(loaded), 2**30, EventLog()))
    try:
        messages = [ChatMessage("system", system_text(system_words))]
        previous_prompt = 0
        for turn in range(TURNS):
            messages.append(ChatMessage("user", question(turn)))
            prompt = tuple(renderer.render(Conversation(tuple(messages))))
            if turn == EVICT_AT:
                engine.call(lambda e: e.ops.evict_agent("weather", Tier.WARM)).result()
            result = run_turn(engine, GenerationRequest("weather", prompt, REPLY_TOKENS), timeout_s=600)
            if turn in CHECKED:
                expected = reference_greedy(loaded.model, list(prompt), REPLY_TOKENS, eos)
                assert result.tokens == without_eos(expected, eos), (turn, result.text)
            usage = result.finish.usage
            if turn:
                assert usage.reused_tokens >= previous_prompt - 1, (turn, usage)
            held, counted = engine.call(lambda e: (held_bytes(e.agents), e.pool.used_bytes)).result()
            assert held == counted, turn
            previous_prompt = len(prompt)
            messages.append(ChatMessage("assistant", rerendered(result.text, turn)))
        if model == "gemma3":
            assert len(prompt) > 512 * 2, "the conversation must outgrow the sliding window"
    finally:
        engine.stop()


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_a_trip_through_the_disk_tier_mid_conversation_changes_nothing(model: str, request, tmp_path) -> None:
    loaded = request.getfixturevalue(model)
    eos = set(loaded.eos_token_ids)
    renderer = PromptRenderer(loaded.tokenizer)
    engine = start_engine(loaded, budget_mb=256, store=WarmStore(tmp_path, stored_model(loaded), 2**30, EventLog()))
    try:
        messages = [ChatMessage("system", system_text(420)), ChatMessage("user", question(0))]
        first = run_turn(engine, GenerationRequest("trip", tuple(renderer.render(Conversation(tuple(messages)))), 8))
        messages += [ChatMessage("assistant", first.text), ChatMessage("user", question(1))]
        engine.call(lambda e: e.ops.evict_agent("trip", Tier.WARM)).result()
        engine.call(lambda e: e._store.flush()).result()
        assert engine.fresh_snapshot().agent("trip").tier == "warm"
        prompt = tuple(renderer.render(Conversation(tuple(messages))))
        second = run_turn(engine, GenerationRequest("trip", prompt, 8), timeout_s=600)
        usage = second.finish.usage
        assert usage.reused_tokens >= len(first.request.prompt_tokens) - 1
        assert second.tokens == without_eos(reference_greedy(loaded.model, list(prompt), 8, eos), eos)
        held, counted = engine.call(lambda e: (held_bytes(e.agents), e.pool.used_bytes)).result()
        assert held == counted
    finally:
        engine.stop()


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_same_prompt_sent_again_computes_only_its_last_token(model: str, request) -> None:
    """A client's retry: the same long prompt again, after a reply. On Gemma 3 the reply has moved
    the 512-token window past the prompt's end, so only the checkpoint kept one token short of it
    can take the cache back; the retry must not prefill the prompt again."""
    loaded = request.getfixturevalue(model)
    eos = set(loaded.eos_token_ids)
    renderer = PromptRenderer(loaded.tokenizer)
    engine = start_engine(loaded, budget_mb=256)
    try:
        conversation = Conversation((ChatMessage("system", system_text(420)), ChatMessage("user", question(0))))
        prompt = tuple(renderer.render(conversation))
        assert len(prompt) > 600
        first = run_turn(engine, GenerationRequest("retry", prompt, 8), timeout_s=600)
        again = run_turn(engine, GenerationRequest("retry", prompt, 8), timeout_s=600)
        usage = again.finish.usage
        assert (usage.reuse_source, usage.reused_tokens, usage.prefilled_tokens) == ("self", len(prompt) - 1, 1)
        assert again.tokens == first.tokens == without_eos(reference_greedy(loaded.model, list(prompt), 8, eos), eos)
    finally:
        engine.stop()
