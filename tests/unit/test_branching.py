"""Fork and rewind on tiny models: shared blocks, exact accounting, token-identical continuation."""

from __future__ import annotations

import pytest

from engine.errors import AgentExistsError, AgentNotFoundError, InvalidRequestError
from engine.runtime.tiers.accounting import held_bytes
from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from tests.support.byte_tokenizer import BOS, EOS
from tests.support.reference import reference_greedy
from tests.unit.test_engine_batching import make_engine, without_eos

pytestmark = pytest.mark.unit

PLANNER = (BOS, *b"You are the planner. The plan has eight parts, one per worker, each a small task. " * 2)


@pytest.fixture(params=["llama", "gemma"])
def engine(request):
    eng = make_engine(request.param, budget_mb=64)
    yield eng
    eng.stop()


def accounts(engine: Engine) -> tuple[int, int]:
    return engine.call(lambda e: (held_bytes(e.agents), e.pool.used_bytes)).result()


def greedy(engine: Engine, prompt: tuple[int, ...], n: int) -> list[int]:
    return without_eos(reference_greedy(engine.loaded.model, list(prompt), n, {EOS}))


def test_forks_share_the_planner_blocks_and_prefill_only_their_own_tokens(engine: Engine) -> None:
    planner = run_turn(engine, GenerationRequest("planner", PLANNER, 6))
    context = PLANNER + tuple(planner.tokens)
    forks = [engine.call(lambda e, i=i: e.ops.fork_agent("planner", f"worker-{i}")).result() for i in range(8)]
    cached = engine.call(lambda e: len(e.agents.get("planner").tokens)).result()
    assert all(f.tokens == cached and f.shared_tokens == cached // 16 * 16 for f in forks)
    shared_ids = engine.call(lambda e: [b for s in e.agents.get("planner").kv.segments for b in s.block_ids]).result()
    if engine.call(lambda e: e.hot.share_by_reference).result():
        assert shared_ids and all(engine.pool.refcount(b) == 9 for b in shared_ids)  # held once, by nine
    held, counted = accounts(engine)
    assert held == counted

    prompts = [context + tuple(f" Worker {i}, do part {i}.".encode()) for i in range(8)]
    results = run_turns(engine, [GenerationRequest(f"worker-{i}", p, 8) for i, p in enumerate(prompts)])
    for result, prompt in zip(results, prompts):
        usage = result.finish.usage
        assert usage.reuse_source == "self" and usage.reused_tokens >= cached - 1, usage
        assert usage.prefilled_tokens == len(prompt) - usage.reused_tokens
        assert result.tokens == greedy(engine, prompt, 8)
    held, counted = accounts(engine)
    assert held == counted


def test_fork_at_a_turn_and_rewind_continue_like_a_fresh_prefill(engine: Engine) -> None:
    prompt, ends = PLANNER, []
    for turn in range(3):
        result = run_turn(engine, GenerationRequest("chat", prompt, 6))
        ends.append(len(prompt) + len(result.tokens))
        prompt = prompt + tuple(result.tokens) + tuple(f" [user {turn}] go on.".encode())
    turn_ends = engine.call(lambda e: list(e.agents.get("chat").turn_ends)).result()
    assert turn_ends == ends  # each turn's prompt and reply, all fed to the cache

    fork = engine.call(lambda e: e.ops.fork_agent("chat", "branch", turn=1)).result()
    assert fork.asked_tokens == turn_ends[0] and 0 < fork.tokens <= turn_ends[0]
    rewound = engine.call(lambda e: e.ops.rewind_agent("chat", turn=2)).result()
    assert rewound.asked_tokens == turn_ends[1] and 0 < rewound.tokens <= turn_ends[1]
    assert engine.call(lambda e: e.agents.get("chat").turn_ends).result() == [
        end for end in turn_ends if end <= rewound.tokens]

    for agent_id, mark in (("branch", b"#"), ("chat", b"%")):
        cached = engine.call(lambda e, a=agent_id: list(e.agents.get(a).tokens)).result()
        # The marks follow no cached position of either agent: each one's own cache is the longest match.
        follow = tuple(cached) + tuple(mark + b" and now?")
        result = run_turn(engine, GenerationRequest(agent_id, follow, 8))
        usage = result.finish.usage
        assert usage.reused_tokens >= len(cached) - 1 and usage.reuse_source == "self", usage
        assert result.tokens == greedy(engine, follow, 8)
    held, counted = accounts(engine)
    assert held == counted


def test_rewind_to_turn_zero_empties_the_cache_and_frees_its_blocks(engine: Engine) -> None:
    run_turn(engine, GenerationRequest("gone", PLANNER, 4))
    used = engine.pool.used_blocks
    branch = engine.call(lambda e: e.ops.rewind_agent("gone", turn=0)).result()
    assert branch.tokens == 0 and engine.pool.used_blocks < used
    assert engine.call(lambda e: e.agents.get("gone").tier).result() is Tier.EMPTY


def test_a_fork_of_an_evicted_agent_reads_it_back_and_errors_are_clear(engine: Engine) -> None:
    run_turn(engine, GenerationRequest("source", PLANNER, 4))
    engine.call(lambda e: e.ops.evict_agent("source", Tier.COLD)).result()
    # Cold: nothing to share; the fork starts empty rather than failing.
    assert engine.call(lambda e: e.ops.fork_agent("source", "empty-fork")).result().tokens == 0
    with pytest.raises(AgentNotFoundError):
        engine.call(lambda e: e.ops.fork_agent("nobody", "x")).result()
    with pytest.raises(AgentExistsError):
        engine.call(lambda e: e.ops.fork_agent("source", "empty-fork")).result()
    with pytest.raises(InvalidRequestError, match="turn 5 is out of range"):
        engine.call(lambda e: e.ops.rewind_agent("source", turn=5)).result()
