"""Families whose caches are not one plain K/V per layer of one width, through the engine, against plain mlx-lm.

DeepSeek V3, GLM-4.7-Flash, Kimi K2.5, Kimi-VL's language model and Mistral 4 (latent attention: one latent
head per token, batched through padded views), DeepSeek V2 (latent attention that caches decompressed per-head
K/V),
Gemma 4 (global layers twice as wide as sliding ones, and layers reading an
earlier layer's K/V), Llama 4 (chunked windows, each row's chunk mask its own): tiny random-weight instances
of mlx-lm's own classes (``tests/support/tiny_models.py``). Every turn is
token-identical to ``generate_step`` on the same prompt; later turns prefill
only what is new; the pool's bytes are what the arrays hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.runner.backends.cpu import linear_kernel
from engine.runtime.engine_thread.engine_ops import EvictAgent, ForkAgent, RewindAgent
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from engine.runtime.tiers.agents import Tier
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.byte_tokenizer import BOS
from tests.support.family_engine import accounts_agree, check, export_then_continue_elsewhere, file_bytes_at_rest, opening, start
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit

LATENT = ["deepseek_v3", "glm4_moe_lite", "kimi_k25", "kimi_vl", "mistral4"]
FAMILIES = [*LATENT, "deepseek_v2", "gemma4_text", "llama4"]
TOKENS = 12


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    return loaded_tiny(request.param)


def test_four_turns_are_token_identical_and_later_turns_prefill_only_what_is_new(loaded) -> None:
    engine = start(loaded)
    try:
        prompt = opening()
        cached = 0
        for turn in range(4):
            result = run_turn(engine, GenerationRequest("chat", prompt, TOKENS))
            check(loaded, result)
            usage = result.finish.usage
            if turn:
                # The cache holds the last prompt and the reply (an end-of-sequence token it fed is not text).
                assert usage.reused_tokens >= cached - 1, (turn, usage)
                assert usage.prefilled_tokens <= len(prompt) - cached + 1
            accounts_agree(engine)
            cached = len(prompt) + len(result.tokens)
            prompt = prompt + tuple(result.tokens) + tuple(f" then turn {turn} says more.".encode())
    finally:
        engine.stop()


def test_agents_batched_together_equal_single_stream(loaded) -> None:
    engine = start(loaded)
    try:
        requests = [GenerationRequest(f"b{i}", (BOS, *(f"agent {i} writes. " * (2 + i)).encode()), TOKENS)
                    for i in range(3)]
        for result in run_turns(engine, requests):
            check(loaded, result)
        accounts_agree(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", FAMILIES)
def test_agents_decode_and_prefill_in_shared_passes_and_resume_their_own_caches(kind: str) -> None:
    """Four agents go through the model together (fails if the family falls back to one sequence a pass), each
    token-identical to plain mlx-lm alone, and their second turns resume their caches."""
    loaded = loaded_tiny(kind)
    engine = start(loaded)
    shapes: list[tuple[int, int]] = []
    forward = engine.backend.forward

    def counted(model, inputs, cache, embeddings=None):
        shapes.append(tuple(inputs.shape))
        return forward(model, inputs, cache, embeddings)

    engine.backend.forward = counted
    try:
        requests = [GenerationRequest(f"l{i}", (BOS, *(f"agent {i} writes. " * (2 + i % 2)).encode()), TOKENS)
                    for i in range(4)]
        for result in run_turns(engine, requests):
            check(loaded, result)
        assert max(rows for rows, tokens in shapes if tokens == 1) == 4, shapes
        assert any(rows > 1 for rows, tokens in shapes if tokens > 1), shapes
        follow = [GenerationRequest(r.request_id, r.prompt_tokens + tuple(b" and then?"), TOKENS) for r in requests]
        for result, first in zip(run_turns(engine, follow), requests):
            check(loaded, result)
            # (A window or chunk resumes from its turn checkpoint, one token short of the last prompt's end.)
            assert result.finish.usage.reused_tokens >= len(first.prompt_tokens) - 1
        accounts_agree(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe_lite"])
def test_a_latent_batch_keeps_its_layers_in_blas_and_gives_its_output_head_the_pass(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, a latent-attention batch step's layers run in BLAS (the pass and BLAS taking turns in one
    step costs) and its output head, the step's last product, takes the linear pass; tokens unchanged."""
    loaded = loaded_tiny(kind)
    vocab = loaded.model.args.vocab_size
    products: list[tuple[int, int]] = []  # (rows, outputs) of each product through the pass
    engine = start(loaded)  # (its compiled pass loaded first: the spy below only records calls)
    real = linear_kernel.times_transposed
    monkeypatch.setattr(linear_kernel, "times_transposed",
                        lambda x, w, *rest: products.append((x.shape[0], w.shape[0])) or real(x, w, *rest))
    try:
        if engine.backend.name != "cpu":
            pytest.skip("the linear pass is the CPU backend's")
        requests = [GenerationRequest(f"h{i}", (BOS, *(f"agent {i} writes. " * 2).encode()), TOKENS) for i in range(4)]
        for result in run_turns(engine, requests):
            check(loaded, result)
    finally:
        engine.stop()
    batched = [outputs for rows, outputs in products if rows > 1]
    assert batched and set(batched) == {vocab}, products


def test_a_cache_evicted_to_disk_comes_back_after_a_restart(loaded, tmp_path: Path) -> None:
    store = WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog())
    engine = start(loaded, store)
    prompt = opening(2)
    try:
        first = run_turn(engine, GenerationRequest("disk", prompt, TOKENS))
        check(loaded, first)
        engine.call(EvictAgent("disk", Tier.WARM)).result(30)
    finally:
        engine.stop()
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    try:
        follow = prompt + tuple(first.tokens) + tuple(b" and after the restart?")
        result = run_turn(engine, GenerationRequest("disk", follow, TOKENS))
        check(loaded, result)
        assert result.finish.usage.reused_tokens >= len(prompt) + len(first.tokens) - 1
        accounts_agree(engine)
    finally:
        engine.stop()


def test_a_second_agent_starts_from_the_first_ones_prefix(loaded) -> None:
    engine = start(loaded)
    try:
        head = (BOS, *(b"a shared system prompt for every agent of the fleet. " * 3))
        first = run_turn(engine, GenerationRequest("one", head + tuple(b"agent one asks."), TOKENS))
        check(loaded, first)
        second = run_turn(engine, GenerationRequest("two", head + tuple(b"agent two asks."), TOKENS))
        check(loaded, second)
        usage = second.finish.usage
        assert usage.reuse_source.startswith("shared:") and usage.reused_tokens >= loaded.spec.block_tokens
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
        # A window layer (sliding, chunked) goes back only as far as a checkpoint: the cut may land before
        # the turn's end, and the next turn computes the difference.
        windowed = any(not g.holds_every_position for g in loaded.spec.groups)
        fork = engine.call(ForkAgent("root", "fork", 1)).result(30)
        rewind = engine.call(RewindAgent("root", 1)).result(30)
        for branch in (fork, rewind):
            assert 0 < branch.tokens <= branch.asked_tokens and (windowed or branch.tokens >= branch.asked_tokens - 1)
        forked = run_turn(engine, GenerationRequest("fork", turns[0] + tuple(b" a fork goes its way."), TOKENS))
        check(loaded, forked)
        assert forked.finish.usage.reused_tokens >= fork.tokens - 1
        rewound = run_turn(engine, GenerationRequest("root", turns[0] + tuple(b" back to turn one."), TOKENS))
        check(loaded, rewound)
        assert rewound.finish.usage.reused_tokens >= rewind.tokens - 1
        accounts_agree(engine)
    finally:
        engine.stop()


def test_a_full_pool_spills_agents_and_brings_them_back_identical(loaded, tmp_path: Path) -> None:
    """A pool that holds about two agents: a third spills the least recently used to disk, whose next turn
    comes back from there."""
    per_agent = loaded.spec.total_blocks_for_tokens(len(opening()) + 2 * TOKENS + 40)
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()), blocks=int(2.5 * per_agent))
    try:
        firsts = {}
        for i in range(3):
            firsts[i] = run_turn(engine, GenerationRequest(f"p{i}", opening(10 + i), TOKENS))
            check(loaded, firsts[i])
        follow = opening(10) + tuple(firsts[0].tokens) + tuple(b" again.")
        again = run_turn(engine, GenerationRequest("p0", follow, TOKENS))
        check(loaded, again)
        assert again.finish.usage.reused_tokens >= len(opening(10)) + len(firsts[0].tokens) - 1
        accounts_agree(engine)
    finally:
        engine.stop()


def test_latent_attention_cannot_be_sharded_by_heads_and_says_so() -> None:
    from engine.distributed.sharded_loading import check_shardable
    from engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="latent attention.*cannot be split across ranks by heads"):
        check_shardable(loaded_tiny("deepseek_v3").spec, "tiny-deepseek")
    check_shardable(loaded_tiny("gemma4_text").spec, "tiny-gemma4")  # heads of K/V: split as usual


def test_the_layer_groups_say_what_each_kind_of_layer_stores() -> None:
    summary = loaded_tiny("gemma4_text").spec.layer_summary()
    assert summary == ("global: 1 layer of 1x64/64 float32 (512 B a token); sliding-24: 5 layers of 1x32/32 "
                       "float32 (1.25 KiB a token); 4 more layers read earlier layers' K/V")
    assert "latent attention" in loaded_tiny("glm4_moe_lite").spec.layer_summary()
    # DeepSeek V2 decompresses its latents: 4 heads of 16 + 16 K dims and 16 V dims, batched as usual.
    v2 = loaded_tiny("deepseek_v2").spec
    assert v2.layer_summary() == "global: 3 layers of 4x32/16 float32 (2.25 KiB a token)"
    assert v2.batchable and not v2.latent
    assert "chunked-24: 3 layers in 3 groups" in loaded_tiny("llama4").spec.layer_summary()


def test_a_chunked_cache_ending_on_a_chunk_boundary_goes_to_disk_and_back(tmp_path: Path) -> None:
    """At a chunk boundary a chunked layer needs nothing of the chunk so far: the file holds no blocks of
    it (nor does the turn-end checkpoint there), and the cache comes back whole."""
    loaded = loaded_tiny("llama4")
    chunk = next(g.chunk for g in loaded.spec.groups if g.chunk)
    prompt = (BOS, *(b"x" * (2 * chunk - 2)))  # and one token of reply, which the cache holds too: 2 chunks
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    try:
        first = run_turn(engine, GenerationRequest("edge", prompt, 1))
        check(loaded, first)
        assert engine.call(lambda e: len(e.agents.get("edge").tokens)).result(30) == 2 * chunk
        engine.call(EvictAgent("edge", Tier.WARM)).result(30)
    finally:
        engine.stop()
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    try:
        follow = prompt + tuple(first.tokens) + tuple(b" and on into the next chunk.")
        result = run_turn(engine, GenerationRequest("edge", follow, TOKENS))
        check(loaded, result)
        assert result.finish.usage.reused_tokens == 2 * chunk
        accounts_agree(engine)
    finally:
        engine.stop()


def test_an_exported_agent_continues_from_its_cache_on_another_machine(loaded, tmp_path: Path) -> None:
    export_then_continue_elsewhere(loaded, tmp_path, TOKENS)


@pytest.mark.parametrize("kind", ["glm4_moe_lite", "gemma4_text"])
def test_eight_bits_at_rest_store_latent_and_mixed_width_caches_smaller_and_resume_them(
        kind: str, tmp_path: Path) -> None:
    """The files shrink as the widths allow (GLM: a 64-wide latent and 32 rotary dims; Gemma 4: heads of 32
    and 64), the cache resumes from them. How closely 8-bit caches agree is measured in
    bench/bench_kv_at_rest.py, not here: a tiny random model's near-tied logits say nothing of it."""
    sizes = file_bytes_at_rest(loaded_tiny(kind), tmp_path, TOKENS, identical=False)
    assert sizes[8] < 0.6 * sizes[None], sizes


def test_a_model_whose_layers_run_twice_is_refused_saying_why() -> None:
    """IQuest Loop Coder runs its layers twice per token, each pass with caches of its own: refused at load
    with the reason, not a failed invariant."""
    from mlx_lm.utils import _get_classes

    from engine.errors import UnsupportedModelError
    from engine.models.cache_spec import derive_cache_spec

    config = dict(model_type="iquestloopcoder", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, head_dim=16, vocab_size=300,
                  rope_theta=500000.0, tie_word_embeddings=False, loop_num=2, loop_window_size=32)
    model_class, args_class = _get_classes(config)
    with pytest.raises(UnsupportedModelError, match="4 caches for 2 layers"):
        derive_cache_spec(model_class(args_class.from_dict(config)), 16)
