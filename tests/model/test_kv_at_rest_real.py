"""--kv-bits-at-rest 8 on the real SmolLM2: an idle agent is cooled (quantized in memory) when the pool
needs room, comes back whole, is written to disk quantized on shutdown and resumes after a restart.

From cool and from disk the agent continues from the same dequantized cache, so its greedy answers
are the same; how close they are to full precision is measured in bench/bench_kv_at_rest.py.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.domain.event_log import EventKind, EventLog
from engine.domain.requests import GenerationRequest, SamplingParams
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.cache_file import read_header
from engine.store.cache_file import KVQuantization
from engine.store.kv_at_rest import quantization_for, round_trip
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.reference import reference_greedy

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)
POOL_BLOCKS = 5  # two agents of two blocks; a third makes room by cooling one


def engine_on(loaded, root: Path) -> Engine:
    events = EventLog()
    store = WarmStore(root, stored_model(loaded), 1 << 30, events, kv_bits_at_rest=8)
    budget = int((POOL_BLOCKS + 0.5) * loaded.spec.block_bytes)
    engine = Engine(loaded, engine_settings(budget, 8, 512, kv_bits_at_rest=8), store=store, events=events)
    engine.start()
    return engine


def chat(loaded, name: str, question: str) -> tuple[int, ...]:
    facts = " ".join(f"Box {k} of {name} holds {k * 3 + len(name)} apples." for k in range(30))
    messages = [{"role": "user", "content": f"{facts}\n{question}"}]
    return tuple(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_an_idle_agent_is_cooled_comes_back_whole_and_survives_a_restart(smollm2, tmp_path: Path) -> None:
    prompts = {name: chat(smollm2, name, "How many apples are in box 4?") for name in ("ann", "bob", "cy")}
    assert all(256 < len(p) < 500 for p in prompts.values())
    engine = engine_on(smollm2, tmp_path)
    try:
        firsts = {name: run_turn(engine, GenerationRequest(name, prompts[name], 12, GREEDY)) for name in prompts}
        snap = engine.fresh_snapshot()
        # The least recently used agent that is not the third's prefix donor (a donor is kept while it donates).
        cooled = [a.agent_id for a in snap.agents if a.tier == "cool"]
        assert len(cooled) == 1 and snap.tiers.cool_agents == 1 and snap.tiers.warm_agents == 0, snap.agents
        name, first = cooled[0], firsts[cooled[0]]
        assert snap.agent(name).blocks == 1  # two float32 blocks of K/V in one at 8 bits
        follow = first.request.prompt_tokens + tuple(first.tokens) + tuple(
            smollm2.tokenizer.encode(" And box 7?", add_special_tokens=False))
        from_cool = run_turn(engine, GenerationRequest(name, follow, 12, GREEDY))
        cached = len(first.request.prompt_tokens) + first.finish.usage.generated_tokens
        assert from_cool.finish.usage.reused_tokens == cached and from_cool.text.strip()
        restores = [e.message for e in engine.events.since(0) if e.kind is EventKind.RESTORE]
        assert any(f"{name}: cool -> hot" in m for m in restores), restores
        engine.call(lambda e: e.ops.evict_agent(name, Tier.COOL)).result()
    finally:
        engine.stop()  # the cool agent is written to disk as it is
    path = next(tmp_path.rglob(f"{name}-*.safetensors"))
    assert read_header(path).kv_quantization == {"bits": 8, "group_size": 64}
    engine = engine_on(smollm2, tmp_path)
    try:
        assert engine.fresh_snapshot().agent(name).tier == "warm"
        from_disk = run_turn(engine, GenerationRequest(name, follow, 12, GREEDY))
        assert from_disk.finish.usage.reused_tokens >= cached
        # The same quantized cache, from memory or from disk: the same greedy answer.
        assert from_disk.tokens == from_cool.tokens
    finally:
        engine.stop()


def test_eight_bit_keeps_at_least_95_percent_of_greedy_choices_per_token(smollm2) -> None:
    """The issue's agreement target, on the engine's own quantize and dequantize: each prompt's cache
    through 8 bits, then the full-precision greedy answer fed through it; at least 95% of positions
    pick the token the full-precision cache picks on the same input (bench_kv_at_rest measures 99.9%
    over 20 prompts x 256 tokens, and the free-running share as well). Keys at 2 bits fail it
    (58 of 96 tokens); 4 bits pass (97% in the benchmark)."""
    model = smollm2.model
    quantization = quantization_for(8, smollm2.spec.head_dim, smollm2.spec.value_head_dim)
    assert quantization == KVQuantization(8, 64)

    def choices(prompt: tuple[int, ...], answer: list[int], at_rest: KVQuantization | None) -> list[int]:
        cache = make_prompt_cache(model)
        model(mx.array([prompt[:-1]]), cache=cache)
        if at_rest is not None:
            for layer in cache:
                layer.keys, layer.values = round_trip(layer.keys, at_rest), round_trip(layer.values, at_rest)
        logits = model(mx.array([[prompt[-1], *answer[:-1]]]), cache=cache)
        return mx.argmax(logits[0], axis=-1).tolist()

    agree = total = 0
    for name in ("ann", "bob"):
        prompt = chat(smollm2, name, "List every box and its apples.")
        answer = reference_greedy(model, list(prompt), 48, set())
        exact, at_rest = choices(prompt, answer, None), choices(prompt, answer, quantization)
        # The pass is aligned: at full precision it picks the greedy answer's own tokens (all of them
        # but float-order near-ties between one long pass and token-by-token decoding).
        assert sum(a == b for a, b in zip(exact, answer)) >= 0.95 * len(answer), (exact, answer)
        agree += sum(a == b for a, b in zip(at_rest, exact))
        total += len(exact)
    assert agree / total >= 0.95, f"{agree} of {total} tokens agree"
