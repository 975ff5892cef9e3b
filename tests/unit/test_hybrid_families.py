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
from engine.runtime.engine_thread.engine_ops import DeleteAgent, EvictAgent, ForkAgent, RewindAgent
from engine.runtime.engine_thread.sync_client import run_turn
from engine.runtime.tiers.agents import Tier
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.byte_tokenizer import BOS
from tests.support.family_engine import accounts_agree, batched_then_second_turns, check, export_then_continue_elsewhere, file_bytes_at_rest, opening, start
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
    batched_then_second_turns(loaded, 4, TOKENS)  # second turns: each resumes its own state in the same batch


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
        fork = engine.call(ForkAgent("root", "fork", 1)).result(30)
        rewind = engine.call(RewindAgent("root", 1)).result(30)
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


def _held_without_snapshots(loaded, snapshots: bool = False) -> int:
    """Pool blocks one agent of ``opening(10)`` holds without its snapshots (a pool in need drops all but the
    newest first), or with them."""
    probe = start(loaded)
    try:
        run_turn(probe, GenerationRequest("probe", opening(10), TOKENS))
        return probe.call(lambda e: [(a.kv.nbytes - (0 if snapshots else a.kv.checkpoint_bytes()))
                                     // e.pool.block_bytes for a in e.agents][0]).result(30)
    finally:
        probe.stop()


def test_a_full_pool_spills_an_agent_to_disk_and_its_next_turn_reuses_it(loaded, tmp_path: Path) -> None:
    """A pool that holds about two agents: a third pushes the least recently used to disk, state and
    snapshots with its attention blocks; its next turn reads them back and prefills only what is new."""
    per_agent = _held_without_snapshots(loaded)
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()), blocks=int(2.5 * per_agent))
    try:
        firsts = {}
        for i in range(3):
            firsts[i] = run_turn(engine, GenerationRequest(f"p{i}", opening(10 + i), TOKENS))
            check(loaded, firsts[i])
        tiers = engine.call(lambda e: {a.agent_id: a.tier for a in e.agents}).result(30)
        assert tiers["p0"] is Tier.WARM, tiers
        follow = opening(10) + tuple(firsts[0].tokens) + tuple(b" again.")
        again = run_turn(engine, GenerationRequest("p0", follow, TOKENS))
        check(loaded, again)
        assert again.finish.usage.reused_tokens >= len(opening(10)) + len(firsts[0].tokens) - 1, again.finish.usage
        accounts_agree(engine)
    finally:
        engine.stop()


def test_a_full_pool_makes_room_for_a_running_turns_snapshot(loaded, tmp_path: Path) -> None:
    """In a pool full of idle agents, each new turn still keeps its snapshot at the prompt's end: room is
    made for it as for the turn's own positions (idle agents' older snapshots, then an idle agent to disk).
    Otherwise a pool under steady pressure keeps no snapshot, and every reply that comes back as other
    tokens sends its agent back to the start of the conversation."""
    per_agent = _held_without_snapshots(loaded, snapshots=True)
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()), blocks=int(2.5 * per_agent))
    try:
        for i in range(4):
            prompt = opening(10 + i)
            check(loaded, run_turn(engine, GenerationRequest(f"s{i}", prompt, TOKENS)))
            offsets = engine.call(lambda e, i=i: [c.offset for c in e.agents.get(f"s{i}").kv.checkpoints]).result(30)
            assert len(prompt) - 1 in offsets, (i, offsets)
        tiers = engine.call(lambda e: [a.tier for a in e.agents]).result(30)
        assert Tier.WARM in tiers, tiers
        accounts_agree(engine)
    finally:
        engine.stop()


def test_a_spilled_agent_keeps_its_newest_snapshot_for_a_reply_the_client_rendered_differently(
        loaded, tmp_path: Path) -> None:
    """A pool in need sends an idle agent to disk with its newest snapshot rather than dropping every snapshot
    first. Its next prompt re-renders the last reply into other tokens (as retokenized text does): the turn
    resumes from the snapshot at the last prompt's end, not from the start of the conversation."""
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    try:
        first = run_turn(engine, GenerationRequest("r0", opening(10), TOKENS))
        offsets = engine.call(lambda e: sorted(c.offset for c in e.agents.get("r0").kv.checkpoints)).result(30)
        assert len(offsets) >= 2 and offsets[-1] == len(opening(10)) - 1, offsets
        # The pool wants every block back (as the next agent's turn would): older snapshots go, then the agent.
        engine.call(lambda e: e.tiers.make_room(e.pool.total_blocks, set())).result(30)
        assert engine.call(lambda e: e.agents.get("r0").tier).result(30) is Tier.WARM
        rerendered = opening(10) + tuple(first.tokens[:-3]) + tuple(b"~~ and again.")
        again = run_turn(engine, GenerationRequest("r0", rerendered, TOKENS))
        check(loaded, again)
        usage = again.finish.usage
        assert usage.cache_outcome == "snapshot", usage
        assert usage.reused_tokens == offsets[-1], usage
        accounts_agree(engine)
    finally:
        engine.stop()


def test_state_and_snapshots_come_back_from_disk_after_a_restart(loaded, tmp_path: Path) -> None:
    """Two turns, evicted to disk, a new engine on the same folder: the third turn resumes where the state
    stood, and an edit of the second question resumes from a snapshot read back from the file."""
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    first_prompt = opening(6)
    try:
        first = run_turn(engine, GenerationRequest("disk", first_prompt, TOKENS))
        second_prompt = first_prompt + tuple(first.tokens) + tuple(b" and the second question.")
        second = run_turn(engine, GenerationRequest("disk", second_prompt, TOKENS))
        check(loaded, second)
        snapshots = engine.call(lambda e: len(e.agents.get("disk").kv.checkpoints)).result(30)
        assert snapshots >= 2
        engine.call(EvictAgent("disk", Tier.WARM)).result(30)
    finally:
        engine.stop()
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    try:
        assert engine.call(lambda e: e.agents.get("disk").tier).result(30) is Tier.WARM
        third_prompt = second_prompt + tuple(second.tokens) + tuple(b" after the restart?")
        third = run_turn(engine, GenerationRequest("disk", third_prompt, TOKENS))
        check(loaded, third)
        assert third.finish.usage.reused_tokens >= len(second_prompt) + len(second.tokens) - 1, third.finish.usage
        restored = engine.call(lambda e: len(e.agents.get("disk").kv.checkpoints)).result(30)
        assert restored >= snapshots, (restored, snapshots)
        edited = first_prompt + tuple(first.tokens) + tuple(b" and a different question.")
        again = run_turn(engine, GenerationRequest("disk", edited, TOKENS))
        check(loaded, again)
        first_end = len(first_prompt) + len(first.tokens)
        assert again.finish.usage.cache_outcome == "snapshot", again.finish.usage
        assert first_end - 1 <= again.finish.usage.reused_tokens <= first_end, again.finish.usage
        accounts_agree(engine)
    finally:
        engine.stop()


def test_a_shared_prefix_stored_on_disk_starts_another_agent_after_a_restart(loaded, tmp_path: Path) -> None:
    """The first agent's system prompt is written once as a prefix file with the state at its end; after a
    restart (no agent hot) a second agent starts from that file and prefills only its own tokens."""
    head = (BOS, *(b"a shared system prompt for every agent of the fleet. " * 3))
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    try:
        check(loaded, run_turn(engine, GenerationRequest("one", head + tuple(b"agent one asks."), TOKENS,
                                                         prefix_hint=len(head))))
        engine.call(lambda e: e._store.flush()).result(30)
        assert list(tmp_path.glob("**/prefixes/*.safetensors"))
        engine.call(DeleteAgent("one")).result(30)
    finally:
        engine.stop()
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    try:
        second = run_turn(engine, GenerationRequest("two", head + tuple(b"agent two asks."), TOKENS,
                                                    prefix_hint=len(head)))
        check(loaded, second)
        usage = second.finish.usage
        block = loaded.spec.block_tokens
        assert usage.reuse_source.startswith("prefix:") and usage.reused_tokens == len(head) // block * block, usage
        accounts_agree(engine)
    finally:
        engine.stop()


def test_an_exported_agent_continues_from_its_state_on_another_machine(tmp_path: Path) -> None:
    export_then_continue_elsewhere(_loaded("qwen3_next"), tmp_path, TOKENS)


@pytest.mark.parametrize("kind", ["qwen3_next", "mamba2"])
def test_eight_bits_at_rest_quantize_attention_blocks_and_keep_the_state_exact(kind: str, tmp_path: Path) -> None:
    """Under --kv-bits-at-rest the attention layers' K/V are quantized on disk and the recurrent state is
    written as it is: a pure recurrent model (Mamba2) resumes token-identical, a hybrid resumes from its
    file (how closely 8-bit K/V agree is measured in bench/, not on a random model's near-tied logits)."""
    sizes = file_bytes_at_rest(_loaded(kind), tmp_path, TOKENS, identical=kind == "mamba2")
    if kind == "mamba2":
        assert abs(sizes[8] - sizes[None]) < 4096, sizes  # nothing to quantize: the state is all it holds
    else:
        assert sizes[8] < sizes[None], sizes


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


def test_a_cooled_hybrid_agent_keeps_its_state_exact_and_resumes(tmp_path: Path) -> None:
    """The cool tier (--kv-bits-at-rest 8) quantizes the attention layers' K/V in memory; the recurrent state
    and its snapshots stay as they were, bit for bit, and the next turn resumes from them."""
    import numpy as np

    loaded = _loaded("qwen3_next")
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()), kv_bits_at_rest=8)

    def states(e) -> list:
        kv = e.agents.get("c").kv
        return [np.array(a) for layer in kv.layers if hasattr(layer, "geometry") for a in layer.arrays]

    try:
        first = run_turn(engine, GenerationRequest("c", opening(7), TOKENS))
        check(loaded, first)
        before = engine.call(states).result(30)
        engine.call(EvictAgent("c", Tier.COOL)).result(30)
        assert engine.call(lambda e: e.agents.get("c").tier).result(30) is Tier.COOL
        engine.call(lambda e: e.tiers.ensure_hot(e.agents.get("c"))).result(30)
        after = engine.call(states).result(30)
        assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))
        follow = opening(7) + tuple(first.tokens) + tuple(b" cooled and back.")
        again = run_turn(engine, GenerationRequest("c", follow, TOKENS))
        assert again.finish.error is None
        assert again.finish.usage.reused_tokens >= len(opening(7)) + len(first.tokens) - 1, again.finish.usage
        accounts_agree(engine)
    finally:
        engine.stop()
