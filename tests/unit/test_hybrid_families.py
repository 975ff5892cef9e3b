"""Models with recurrent layers (linear attention, Mamba, RWKV) through the engine, against plain mlx-lm.

Hybrids (Qwen3.5, Qwen3-Next, Nemotron-H, Granite 4.0-H, LFM2, Kimi Linear,
Jamba) keep K/V blocks for their attention layers and one fixed-size state
per sequence for each recurrent layer; pure recurrent models (Mamba, Mamba2,
RWKV-7) keep only states. Tiny random-weight instances of mlx-lm's own
classes, from mlx-lm's test configs (``bench/family_configs.json``). A state
cannot be cut back: a cache resumes where the state stands, or from a
snapshot (a checkpoint of the recurrent layers: one token short of each
prompt's end, at shared prefixes). Every turn is token-identical to
``generate_step`` on the same prompt; the pool's bytes are what the arrays
hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.errors import InvalidRequestError
from engine.runtime.engine_thread.engine_ops import engine_op
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from engine.runtime.tiers.agents import Tier
from engine.store.warm_store import WarmStore
from tests.support.byte_tokenizer import BOS
from tests.support.family_engine import accounts_agree, check, opening, start
from tests.support.tiny_models import RECURRENT_FAMILIES, loaded_tiny

pytestmark = pytest.mark.unit

TOKENS = 10
# The features beyond four turns, on one family of each kind of recurrent layer: gated delta net (Qwen3-Next),
# Mamba2 mixer in a hybrid (Nemotron-H), short convolution (LFM2), pure Mamba2, pure RWKV-7.
FEATURE_FAMILIES = ["qwen3_next", "nemotron_h", "lfm2", "mamba2", "rwkv7"]

_LOADED: dict[str, object] = {}


def _loaded(kind: str):
    if kind not in _LOADED:
        _LOADED[kind] = loaded_tiny(kind)
    return _LOADED[kind]


@pytest.fixture(params=RECURRENT_FAMILIES)
def any_family(request):
    return _loaded(request.param)


@pytest.fixture(params=FEATURE_FAMILIES)
def loaded(request):
    return _loaded(request.param)


def test_the_spec_says_which_layers_keep_state(any_family) -> None:
    spec = any_family.spec
    assert spec.recurrent_groups and spec.state_bytes > 0
    assert "recurrent:" in spec.layer_summary()
    if any_family.architecture in ("mamba", "mamba2", "rwkv7"):
        assert all(g.is_recurrent for g in spec.groups)  # no attention layer: no block ever grows
        assert spec.total_blocks_for_tokens(5000) == spec.total_blocks_for_tokens(1)


def test_four_turns_are_token_identical_and_later_turns_prefill_only_what_is_new(any_family) -> None:
    loaded = any_family
    engine = start(loaded)
    try:
        prompt = opening()
        cached = 0
        for turn in range(4):
            result = run_turn(engine, GenerationRequest("chat", prompt, TOKENS))
            check(loaded, result)
            usage = result.finish.usage
            if turn:
                # The state stands after the last token fed: the prompt and the reply but its last token.
                assert usage.reused_tokens >= cached - 1, (turn, usage)
                assert usage.prefilled_tokens <= len(prompt) - cached + 1
            accounts_agree(engine)
            cached = len(prompt) + len(result.tokens)
            prompt = prompt + tuple(result.tokens) + tuple(f" then turn {turn} says more.".encode())
    finally:
        engine.stop()


def test_a_turn_that_edits_an_earlier_message_resumes_from_a_snapshot(loaded) -> None:
    engine = start(loaded)
    try:
        first_prompt = opening(4)
        first = run_turn(engine, GenerationRequest("edit", first_prompt, TOKENS))
        check(loaded, first)
        second_prompt = first_prompt + tuple(first.tokens) + tuple(b" and the second question.")
        second = run_turn(engine, GenerationRequest("edit", second_prompt, TOKENS))
        check(loaded, second)
        # The client rewrites the second question. The state stands past it; the turn resumes from the
        # snapshot taken when the second turn started (the first turn's end: the reply's last token is in the
        # state when the step that sampled it ran on) and computes the rest.
        edited = first_prompt + tuple(first.tokens) + tuple(b" and a different question.")
        again = run_turn(engine, GenerationRequest("edit", edited, TOKENS))
        check(loaded, again)
        usage = again.finish.usage
        first_end = len(first_prompt) + len(first.tokens)
        assert first_end - 1 <= usage.reused_tokens <= first_end, usage
        assert usage.cache_outcome == "snapshot" and usage.diverged_at is not None, usage
        # The same prompt sent twice (a client's retry) resumes one token short of its end.
        retry = run_turn(engine, GenerationRequest("edit", edited, TOKENS))
        check(loaded, retry)
        assert retry.finish.usage.reused_tokens == len(edited) - 1, retry.finish.usage
        accounts_agree(engine)
    finally:
        engine.stop()


def test_agents_batched_together_equal_single_stream(loaded) -> None:
    engine = start(loaded)
    try:
        requests = [GenerationRequest(f"b{i}", (BOS, *(f"agent {i} writes. " * (2 + i)).encode()), TOKENS + 2 * i)
                    for i in range(4)]
        for result in run_turns(engine, requests):
            check(loaded, result)
        # Second turns of all four together: each resumes its own state in the same batch.
        follow = [GenerationRequest(r.request_id, r.prompt_tokens + tuple(b" and then?"), TOKENS) for r in requests]
        for result in run_turns(engine, follow):
            check(loaded, result)
            assert result.finish.usage.reused_tokens > 0
        accounts_agree(engine)
    finally:
        engine.stop()


def test_a_second_agent_starts_from_the_first_ones_prefix(loaded) -> None:
    engine = start(loaded)
    try:
        head = (BOS, *(b"a shared system prompt for every agent of the fleet. " * 3))
        first = run_turn(engine, GenerationRequest("one", head + tuple(b"agent one asks."), TOKENS,
                                                   prefix_hint=len(head)))
        check(loaded, first)
        second = run_turn(engine, GenerationRequest("two", head + tuple(b"agent two asks."), TOKENS,
                                                    prefix_hint=len(head)))
        check(loaded, second)
        usage = second.finish.usage
        assert usage.reuse_source.startswith("shared:") and usage.reused_tokens >= loaded.spec.block_tokens, usage
        assert usage.prefilled_tokens <= len(second.request.prompt_tokens) - usage.reused_tokens
        accounts_agree(engine)
    finally:
        engine.stop()


def test_fork_and_rewind_continue_as_a_fresh_prefill_would(loaded) -> None:
    engine = start(loaded)
    try:
        prompt = opening(3)
        turns = []
        for turn in range(2):
            result = run_turn(engine, GenerationRequest("root", prompt, TOKENS))
            check(loaded, result)
            turns.append(prompt + tuple(result.tokens))
            prompt = turns[-1] + tuple(f" next {turn}.".encode())
        # A recurrent state goes back only to a snapshot: turn one's end lands on the one kept one token
        # short of turn two's prompt end... or earlier; the next turn computes the difference.
        fork = engine.call(engine_op("fork_agent", "root", "fork", 1)).result(30)
        rewind = engine.call(engine_op("rewind_agent", "root", 1)).result(30)
        for branch in (fork, rewind):
            assert 0 < branch.tokens <= branch.asked_tokens
        forked = run_turn(engine, GenerationRequest("fork", turns[0] + tuple(b" a fork goes its way."), TOKENS))
        check(loaded, forked)
        assert forked.finish.usage.reused_tokens >= fork.tokens - 1
        rewound = run_turn(engine, GenerationRequest("root", turns[0] + tuple(b" back to turn one."), TOKENS))
        check(loaded, rewound)
        assert rewound.finish.usage.reused_tokens >= rewind.tokens - 1
        accounts_agree(engine)
    finally:
        engine.stop()


def test_a_full_pool_drops_an_agent_cold_and_its_next_turn_is_identical(loaded, tmp_path: Path) -> None:
    """A pool that holds about two agents: a third pushes the least recently used out. Recurrent state stays in
    memory only, so that agent goes cold (not to disk), says why, and its next turn computes its prompt."""
    probe = start(loaded)
    try:
        run_turn(probe, GenerationRequest("probe", opening(10), TOKENS))
        # What an agent holds without its snapshots (which a pool in need drops first).
        per_agent = probe.call(lambda e: [(a.kv.nbytes - a.kv.checkpoint_bytes()) // e.pool.block_bytes
                                          for a in e.agents][0]).result(30)
    finally:
        probe.stop()
    engine = start(loaded, WarmStore(tmp_path, loaded, 1 << 30, EventLog()), blocks=int(2.5 * per_agent))
    try:
        firsts = {}
        for i in range(3):
            firsts[i] = run_turn(engine, GenerationRequest(f"p{i}", opening(10 + i), TOKENS))
            check(loaded, firsts[i])
        tiers = engine.call(lambda e: {a.agent_id: a.tier for a in e.agents}).result(30)
        assert tiers["p0"] is Tier.COLD and Tier.WARM not in tiers.values(), tiers
        lines = [e.message for e in engine.events.since(0)]
        assert any("p0: hot -> cold" in m and "kept in memory only" in m for m in lines), lines
        follow = opening(10) + tuple(firsts[0].tokens) + tuple(b" again.")
        again = run_turn(engine, GenerationRequest("p0", follow, TOKENS))
        check(loaded, again)
        accounts_agree(engine)
        assert not list(tmp_path.glob("**/*.safetensors"))
    finally:
        engine.stop()


def test_exporting_an_agent_says_why_it_cannot(tmp_path: Path) -> None:
    loaded = _loaded("qwen3_next")
    engine = start(loaded, WarmStore(tmp_path, loaded, 1 << 30, EventLog()))
    try:
        check(loaded, run_turn(engine, GenerationRequest("x", opening(), TOKENS)))
        with pytest.raises(InvalidRequestError, match="recurrent layers' state is kept in memory only"):
            engine.write_agent("x")
    finally:
        engine.stop()


def test_a_model_with_recurrent_layers_cannot_be_sharded_and_says_so() -> None:
    from engine.distributed.sharded_loading import check_shardable
    from engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="recurrent layers .* run it in one process"):
        check_shardable(_loaded("nemotron_h").spec, "tiny-nemotron_h")


def test_a_turn_that_needed_a_dropped_snapshot_says_which_and_why(loaded) -> None:
    """Under a snapshot budget that keeps one turn snapshot, the third turn edits the second's question:
    the snapshot it needed (the first turn's end) was dropped for a later one, and the note says so."""
    engine = start(loaded, snapshot_budget_mb=1e-6)  # room for one: only the latest is kept
    try:
        first_prompt = opening(4)
        first = run_turn(engine, GenerationRequest("budget", first_prompt, TOKENS))
        second_prompt = first_prompt + tuple(first.tokens) + tuple(b" and the second question.")
        second = run_turn(engine, GenerationRequest("budget", second_prompt, TOKENS))
        check(loaded, second)
        edited = first_prompt + tuple(first.tokens) + tuple(b" and a different question.")
        again = run_turn(engine, GenerationRequest("budget", edited, TOKENS))
        check(loaded, again)  # still token-identical: computed from further back
        usage = again.finish.usage
        first_end = len(first_prompt) + len(first.tokens)
        assert usage.reused_tokens < first_end - 1, usage
        assert "was dropped: only the latest 1 turn snapshot is kept" in (usage.reuse_note or ""), usage
        history = engine.fresh_snapshot().agent("budget").history
        assert "was dropped" in (history[-1].note or "")
        accounts_agree(engine)
    finally:
        engine.stop()
