"""Warm turns on resident caches (tiny models): cost, exact accounting, window checkpoints, no leaks."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from engine.runtime.tiers.accounting import held_bytes
from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from tests.support.byte_tokenizer import BOS, EOS
from tests.support.reference import reference_greedy
from tests.unit.test_engine_batching import make_engine, prompt_for, without_eos

pytestmark = pytest.mark.unit


@pytest.fixture(params=["llama", "gemma"])
def engine(request):
    eng = make_engine(request.param)
    yield eng
    eng.stop()


def accounts(engine: Engine) -> tuple[int, int]:
    """(bytes the hot caches' arrays measure, bytes the pool counts), read on the engine thread."""
    return engine.call(lambda e: (held_bytes(e.agents), e.pool.used_bytes)).result()


def test_the_pool_counts_exactly_the_arrays_after_every_turn(engine: Engine) -> None:
    system = (BOS, *b"You are one of several agents sharing this system prompt. " * 3)
    turns = [
        GenerationRequest("a", system + tuple(b"Task A."), 12),
        GenerationRequest("b", system + tuple(b"Task B, different."), 12),  # shares a's prefix
        GenerationRequest("a", system + tuple(b"Task A. And more."), 12),  # diverges inside a's last reply
        GenerationRequest("side", system + tuple(b"Title?"), 4, auxiliary=True),
        GenerationRequest("a", system[:20] + tuple(b"rewritten"), 8),  # back inside the shared prefix
    ]
    for request in turns:
        result = run_turn(engine, request)
        assert result.finish.error is None
        held, counted = accounts(engine)
        assert held == counted > 0, request.agent_id
    engine.call(lambda e: e.ops.evict_agent("b", Tier.COLD)).result()
    held, counted = accounts(engine)
    assert held == counted


def test_a_warm_turn_copies_no_kv(engine: Engine) -> None:
    first = run_turn(engine, GenerationRequest("w", prompt_for(0, 2), 8))
    follow_up = first.request.prompt_tokens + tuple(first.tokens) + (EOS,) + tuple(b" ok")
    second = run_turn(engine, GenerationRequest("w", follow_up, 4))
    usage = second.finish.usage
    assert usage.reused_tokens == len(follow_up) - 1 or usage.reuse_source == "self"
    # The cache had room for these tokens: nothing was gathered, grown or cut.
    assert usage.copied_bytes == 0
    assert usage.handoff_in_s < 0.5 and usage.handoff_out_s < 0.5


def test_rerendered_replies_resume_from_the_prompt_end_and_match_a_fresh_prefill() -> None:
    """20 turns whose prompts diverge right after, or a few tokens into, the previous reply (a client
    re-sending the reply re-rendered): the sliding-window layers resume from the prompt-end checkpoint."""
    engine = make_engine("gemma")  # window 24, blocks of 16: every turn's prompt is past the window
    try:
        prompt = (BOS, *b"A conversation between a user and an assistant about the weather today. ")
        from_checkpoint = 0
        for turn in range(20):
            # 14 tokens: more than the ring holds beyond the window, so only a checkpoint can go back.
            result = run_turn(engine, GenerationRequest("chat", prompt, 14))
            assert result.tokens == without_eos(reference_greedy(engine.loaded.model, list(prompt), 14, {EOS}))
            usage = result.finish.usage
            if turn:
                # The checkpoint lies one token before the previous prompt's end (see the next test).
                assert usage.reused_tokens >= previous_prompt_len - 1, (turn, usage)
                from_checkpoint += "checkpoint" in (usage.reuse_note or "")
            held, counted = accounts(engine)
            assert held == counted
            previous_prompt_len = len(prompt)
            kept = result.tokens[: turn % 3]  # 0, 1 or 2 reply tokens survive the re-rendering
            prompt = prompt + tuple(kept) + tuple(f"[reply {turn} re-rendered] User: and then? ".encode())
        assert from_checkpoint >= 10
    finally:
        engine.stop()


def test_a_prompt_sent_again_resumes_one_token_short_of_its_end() -> None:
    """A client's retry sends the same prompt again after the reply has pushed the window past it:
    the window layers go back to the prompt-end checkpoint, which lies before the last prompt token
    (whose logits the retry needs), and the retry computes that one token only."""
    engine = make_engine("gemma")  # window 24: a 30-token reply leaves the prompt behind the ring
    try:
        prompt = (BOS, *b"A conversation between a user and an assistant about the weather today. ")
        first = run_turn(engine, GenerationRequest("retry", prompt, 30))
        again = run_turn(engine, GenerationRequest("retry", prompt, 30))
        usage = again.finish.usage
        assert usage.reuse_source == "self" and usage.reused_tokens == len(prompt) - 1, usage
        assert again.tokens == first.tokens == without_eos(
            reference_greedy(engine.loaded.model, list(prompt), 30, {EOS}))
        held, counted = accounts(engine)
        assert held == counted
    finally:
        engine.stop()


def test_turns_leave_no_arrays_behind() -> None:
    engine = make_engine("gemma")
    try:
        run_turn(engine, GenerationRequest("warmup", prompt_for(0), 4))
        engine.call(lambda e: e.ops.evict_idle(Tier.COLD)).result()
        baseline = engine.call(lambda e: (gc.collect(), mx.get_active_memory())[1]).result()
        results = run_turns(engine, [GenerationRequest(f"m{i}", prompt_for(i, 3), 12) for i in range(6)])
        assert all(r.finish.error is None for r in results)
        busy = engine.call(lambda e: mx.get_active_memory()).result()
        assert busy > baseline
        engine.call(lambda e: e.ops.evict_idle(Tier.COLD)).result()
        after = engine.call(lambda e: (gc.collect(), mx.get_active_memory())[1]).result()
        # Every cache, checkpoint and batch array is gone once the agents are dropped.
        assert after <= baseline + 64 * 1024, (baseline, busy, after)
    finally:
        engine.stop()
