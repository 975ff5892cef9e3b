"""Agents that start with the same prompt share its blocks instead of prefilling it again."""

from __future__ import annotations

import pytest

from engine.domain.block_layout import common_prefix_length
from engine.domain.prefix_index import PrefixIndex, chain_keys
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.runtime.scheduler.shared_prefill import awaits_leader
from engine.runtime.scheduler.turn import Turn
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
        engine.call(lambda e: e.ops.delete_agent("donor")).result()
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


def test_agents_starting_together_share_the_prefix_before_the_first_turn_ends() -> None:
    """A burst of new agents with one system prompt prefills it once: the leader shares it mid-turn."""
    engine = make_engine("llama")
    try:
        tasks = [b"Task one.", b"Another task.", b"A third, longer task here.", b"Four."]
        requests = [GenerationRequest(f"a{i}", SYSTEM + tuple(task), 6) for i, task in enumerate(tasks)]
        results = run_turns(engine, requests)
        usages = [r.finish.usage for r in results]
        leaders = [u for u in usages if u.reuse_source == "none"]
        followers = [u for u in usages if u.reuse_source.startswith("shared:")]
        assert len(leaders) == 1 and len(followers) == 3
        # At least the system prompt's 8 whole blocks, at most what the prompt has in common with another.
        for request, usage in zip(requests, usages):
            common = max(common_prefix_length(request.prompt_tokens, other.prompt_tokens)
                         for other in requests if other is not request)
            assert usage.reuse_source == "none" or len(SYSTEM) // 16 * 16 <= usage.reused_tokens <= common
        for request, result in zip(requests, results):
            expected = reference_greedy(engine.loaded.model, list(request.prompt_tokens), 6, {EOS})
            assert result.tokens == without_eos(expected)
        snap = engine.fresh_snapshot()
        assert snap.pool.shared_blocks == len(SYSTEM) // 16
        # Every block is accounted to an agent's cache: nothing reserved and left behind.
        held = {b for a in engine.call(lambda e: list(e.agents)).result() for b in a.hot_block_ids()}
        assert snap.pool.used_blocks == len(held)
    finally:
        engine.stop()


def test_a_turn_waits_only_for_a_running_leader_that_has_not_shared_yet() -> None:
    def turn(agent: str, prompt: tuple[int, ...]) -> Turn:
        return Turn(GenerationRequest(agent, prompt, 4), lambda event: None)

    leader, follower = turn("lead", SYSTEM + tuple(b"x" * 40)), turn("follow", SYSTEM + tuple(b"Mine."))
    leader.share_at = 160
    assert awaits_leader(follower, None, [leader], 16)
    assert not awaits_leader(follower, None, [], 16)  # leader finished or cancelled: go ahead
    assert not awaits_leader(turn("other", tuple(b"z" * 40)), None, [leader], 16)  # another prefix
    assert not awaits_leader(turn("lead", SYSTEM), None, [leader], 16)  # the leader's own next turn
    warm = AgentRecord("follow")
    warm.tier = Tier.WARM
    assert not awaits_leader(follower, warm, [leader], 16)  # its own cache on disk serves it better
    leader.published = True
    assert not awaits_leader(follower, None, [leader], 16)  # shared: the pool's donors take over


def test_index_nominates_a_common_head_shorter_than_a_block() -> None:
    index = PrefixIndex(64)
    head = list(range(1, 27))  # 26 tokens: one whole 16-token chunk in common
    index.update("x", head + [100] * 30)
    assert index.candidates(head + [200] * 30) == []
    assert index.head_candidates(head + [200] * 30) == ["x"]
    assert index.head_candidates(head[:15] + [200] * 30) == []  # less than one chunk: not worth it
    assert index.head_candidates(head, exclude="x") == []


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_a_common_head_shorter_than_a_block_is_shared_token_exactly(kind: str) -> None:
    """A template's default system prompt (26 tokens on SmolLM2) is copied from another agent, not prefilled."""
    engine = make_engine(kind, block_tokens=64)
    try:
        head = (BOS, *b"You are a helpful AI.\n")  # 22 tokens, under one 64-token block
        run_turn(engine, GenerationRequest("first", head + tuple(b"Say one thing, then stop."), 6))
        prompt = head + tuple(b"Another question here?")
        second = run_turn(engine, GenerationRequest("second", prompt, 6))
        usage = second.finish.usage
        assert usage.reuse_source == "shared:first"
        if kind == "llama":
            assert usage.reused_tokens == len(head)
        else:
            # The tiny Gemma's 24-token window has moved past the head: its layers resume from the
            # donor's last checkpoint inside it.
            assert 0 < usage.reused_tokens <= len(head)
        assert usage.prefilled_tokens == len(prompt) - usage.reused_tokens
        assert second.tokens == without_eos(reference_greedy(engine.loaded.model, list(prompt), 6, {EOS}))
        # Nothing whole was shared, so nothing is held twice.
        assert engine.fresh_snapshot().pool.shared_blocks == 0
    finally:
        engine.stop()
