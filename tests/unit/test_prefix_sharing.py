"""Agents that start with the same prompt share its blocks instead of prefilling it again."""

from __future__ import annotations

from engine.domain.prefix_index import PrefixIndex, chain_keys
from engine.runtime.requests import GenerationRequest
from engine.runtime.sync_client import run_turn
from tests.support.byte_tokenizer import BOS, EOS
from tests.support.reference import reference_greedy
from tests.unit.test_engine_batching import make_engine, without_eos

SYSTEM = (BOS, *b"You are a careful assistant. Use the tools. " * 3)  # 133 tokens: 8 blocks of 16


def test_chain_keys_depend_on_the_whole_prefix() -> None:
    a = chain_keys(list(range(40)), 16)
    b = chain_keys([99] + list(range(1, 40)), 16)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]


def test_index_nominates_the_agents_with_the_longest_prefix() -> None:
    index = PrefixIndex(4)
    index.update("x", [1, 2, 3, 4, 5, 6, 7, 8])
    index.update("y", [1, 2, 3, 4, 9, 9, 9, 9])
    assert index.candidates([1, 2, 3, 4, 5, 6, 7, 8, 0]) == [("x", 2)]
    assert index.candidates([1, 2, 3, 4, 0]) == [("x", 1), ("y", 1)]
    assert index.candidates([1, 2, 3, 4], exclude="x") == [("y", 1)]
    index.remove("x")
    assert index.candidates([1, 2, 3, 4, 5, 6, 7, 8]) == [("y", 1)]


def test_new_agent_shares_another_agents_prefix_blocks() -> None:
    engine = make_engine("llama")
    try:
        first = run_turn(engine, GenerationRequest("first", SYSTEM + tuple(b"Task one."), 6))
        used_before = engine.fresh_snapshot().pool.used_blocks
        prompt = SYSTEM + tuple(b"A different task entirely.")
        second = run_turn(engine, GenerationRequest("second", prompt, 6))
        usage = second.finish.usage
        assert usage.reuse_source == "shared:first"
        assert usage.reused_tokens == len(SYSTEM)
        assert second.tokens == without_eos(reference_greedy(engine.loaded.model, list(prompt), 6, {EOS}))
        snap = engine.fresh_snapshot()
        # The 8 complete system-prompt blocks are held by both agents, stored once.
        assert snap.pool.shared_blocks == len(SYSTEM) // 16
        assert snap.pool.used_blocks < used_before * 2
        assert first.finish.usage.reuse_source == "none"
    finally:
        engine.stop()


def test_shared_blocks_survive_the_donor_leaving() -> None:
    engine = make_engine("llama")
    try:
        run_turn(engine, GenerationRequest("donor", SYSTEM + tuple(b"one"), 4))
        taker = run_turn(engine, GenerationRequest("taker", SYSTEM + tuple(b"two"), 4))
        engine.call(lambda e: e.delete_agent("donor")).result()
        follow = taker.request.prompt_tokens + tuple(taker.tokens) + tuple(b" more")
        again = run_turn(engine, GenerationRequest("taker", follow, 4))
        assert again.finish.usage.reuse_source == "self"
        assert again.tokens == without_eos(reference_greedy(engine.loaded.model, list(follow), 4, {EOS}))
        assert engine.fresh_snapshot().pool.shared_blocks == 0
    finally:
        engine.stop()


def test_sharing_can_be_turned_off() -> None:
    engine = make_engine("llama", prefix_sharing=False)
    try:
        run_turn(engine, GenerationRequest("a", SYSTEM + tuple(b"x"), 2))
        b = run_turn(engine, GenerationRequest("b", SYSTEM + tuple(b"y"), 2))
        assert b.finish.usage.reused_tokens == 0
    finally:
        engine.stop()
