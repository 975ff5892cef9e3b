"""The engine on the real packaged models: batched greedy equals single-stream, reuse equals fresh prefill."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from engine.domain.requests import GenerationRequest
from tests.model.engine_fixtures import start_engine
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from tests.support.prefill_passes import record_prefill_passes
from tests.support.reference import reference_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Who wrote Hamlet?",
    "Give me a synonym for happy.",
    "What does a CPU do?",
    "Translate 'good morning' to Spanish.",
]
GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "The three primary colours are",
    "Once upon a time, in a small village,",
    "The speed of light is",
    "Water boils at",
    "The largest planet in the solar system is",
    "In 1969, the first man on the moon was",
]
MAX_TOKENS = 16
# The prefill-pass tests' answers: a row that a shared pass (or padding) mixed up shows in its first tokens,
# and each Gemma 3 token of a plain mlx-lm reference costs ~0.35 s on a 2-core CPU (eight references a test).
PASS_TOKENS = 8


def chat_prompt(loaded, question: str, history: list[dict] | None = None) -> tuple[int, ...]:
    messages = (history or []) + [{"role": "user", "content": question}]
    return tuple(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def raw_prompt(loaded, text: str) -> tuple[int, ...]:
    return tuple(loaded.tokenizer.encode(text))


def without_eos(loaded, tokens: list[int]) -> list[int]:
    eos = set(loaded.eos_token_ids)
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def prompts_for(loaded, n: int) -> list[tuple[int, ...]]:
    if loaded.architecture == "llama":
        return [chat_prompt(loaded, q) for q in QUESTIONS[:n]]
    return [raw_prompt(loaded, p) for p in GEMMA_PROMPTS[:n]]


@pytest.fixture(params=["smollm2", "gemma3"], scope="module")
def engine(request):
    loaded = request.getfixturevalue(request.param)
    eng = start_engine(loaded)
    yield eng
    eng.stop()


@pytest.mark.parametrize("n_agents", [1, 3, 8])
def test_concurrent_greedy_equals_single_stream_mlx_lm(engine, n_agents: int) -> None:
    loaded = engine.loaded
    prompts = prompts_for(loaded, n_agents)
    results = run_turns(engine, [GenerationRequest(f"agent-{n_agents}-{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)])
    for result, prompt in zip(results, prompts):
        expected = reference_greedy(loaded.model, list(prompt), MAX_TOKENS, set(loaded.eos_token_ids))
        assert result.tokens == without_eos(loaded, expected), loaded.tokenizer.decode(result.tokens)


def test_equal_length_prompts_prefilled_in_one_pass_equal_single_stream(engine) -> None:
    """Eight prompts cut to one length are prefilled together (one forward pass per chunk, each row at
    its own cache); every agent's greedy tokens still equal single-stream mlx_lm on its own prompt."""
    loaded = engine.loaded
    prompts = prompts_for(loaded, 8)
    length = min(len(p) for p in prompts)
    prompts = [p[:length] for p in prompts]
    results = run_turns(engine, [GenerationRequest(f"together-{i}", p, PASS_TOKENS) for i, p in enumerate(prompts)])
    for result, prompt in zip(results, prompts):
        expected = reference_greedy(loaded.model, list(prompt), PASS_TOKENS, set(loaded.eos_token_ids))
        assert result.tokens == without_eos(loaded, expected), loaded.tokenizer.decode(result.tokens)


def test_prompts_of_different_lengths_prefilled_padded_in_one_pass_equal_single_stream(
    engine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight chat prompts of different lengths arriving together: on SmolLM2 (no sliding windows) the
    shorter ones ride the longest one's pass padded; on Gemma 3 only equal chunks group. Every agent's
    greedy tokens equal single-stream mlx_lm, and its cache holds exactly its prompt and answer."""
    groups = record_prefill_passes(monkeypatch)
    loaded = engine.loaded
    # Prompts no other test sends: an agent holding the same prompt would share it whole, and
    # nothing would be left to prefill.
    if loaded.architecture == "llama":
        prompts = [chat_prompt(loaded, f"In one sentence: {q}") for q in QUESTIONS]
    else:
        prompts = [raw_prompt(loaded, f"Notes. {p}") for p in GEMMA_PROMPTS]
    assert len({len(p) for p in prompts}) > 1
    requests = [GenerationRequest(f"padded-{i}", p, PASS_TOKENS) for i, p in enumerate(prompts)]
    results = run_turns(engine, requests)
    assert groups, "no prefill pass ran"
    padded = [sizes for sizes, n in groups if len(sizes) > 1 and min(sizes) < n]
    assert bool(padded) == (loaded.architecture == "llama"), groups
    for result, prompt in zip(results, prompts):
        expected = reference_greedy(loaded.model, list(prompt), PASS_TOKENS, set(loaded.eos_token_ids))
        assert result.tokens == without_eos(loaded, expected), loaded.tokenizer.decode(result.tokens)
    held = engine.call(lambda e: [(len(e.agents.get(r.agent_id).tokens), e.agents.get(r.agent_id).kv.offset)
                                  for r in requests]).result()
    assert all(tokens == offset for tokens, offset in held), held


def test_second_turn_reuses_cache_and_equals_fresh_prefill(engine) -> None:
    loaded = engine.loaded
    if loaded.architecture == "llama":
        first_prompt = chat_prompt(loaded, QUESTIONS[0])
    else:
        first_prompt = raw_prompt(loaded, GEMMA_PROMPTS[1])
    first = run_turn(engine, GenerationRequest("multi-turn", first_prompt, MAX_TOKENS))
    if loaded.architecture == "llama":
        history = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first.text}]
        second_prompt = chat_prompt(loaded, "And the capital of Germany?", history)
    else:
        second_prompt = first_prompt + tuple(first.tokens) + raw_prompt(loaded, "\n\ndef factorial(n):")[1:]
    second = run_turn(engine, GenerationRequest("multi-turn", second_prompt, MAX_TOKENS))
    usage = second.finish.usage
    assert usage.reuse_source == "self"
    assert usage.reused_tokens >= len(first_prompt)
    assert usage.reused_tokens + usage.prefilled_tokens == len(second_prompt)
    expected = reference_greedy(loaded.model, list(second_prompt), MAX_TOKENS, set(loaded.eos_token_ids))
    assert second.tokens == without_eos(loaded, expected)


def quantized_greedy(loaded, prompt: tuple[int, ...], max_tokens: int, bits: int) -> list[int]:
    """Plain mlx-lm greedy with its own quantized cache (QuantizedKVCache, groups of 64) from the first token on
    the layers it keeps whole K/V for; a sliding window's cache as the model makes it."""
    caches = [QuantizedKVCache(group_size=64, bits=bits) if type(c) is KVCache else c for c in loaded.model.make_cache()]
    eos, out = set(loaded.eos_token_ids), []
    for token, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=max_tokens, prompt_cache=caches):
        out.append(int(token))
        if out[-1] in eos:
            break
    return out


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_kv_quantized_in_the_pool_gives_mlx_lms_tokens_with_its_quantized_cache_and_reuses_it(
        request, model_name: str) -> None:
    """--kv-bits 8: agents decoding together, and a second turn that reuses the packed cache, give plain
    mlx-lm's greedy tokens with its QuantizedKVCache (Gemma 3: its global layers packed, its windows whole).

    Through MLX's own kernels, as Metal and CUDA run: the CPU backend's compiled activations differ from MLX's
    by an ulp, which quantization turns into other codes now and then (a value at a rounding edge), as large
    as quantization's own error (SmolLM2's first logits: 0.38 against 0.42 from full precision), so there
    greedy tokens are compared with full precision's in bench/bench_kv_at_rest.py instead."""
    loaded = request.getfixturevalue(model_name)
    packed = replace(loaded, spec=loaded.spec.with_hot_kv(8, 64))
    tokens = MAX_TOKENS if loaded.architecture == "llama" else PASS_TOKENS
    engine = start_engine(packed, fast_cpu_math=False)
    try:
        prompts = prompts_for(loaded, 2)
        results = run_turns(engine, [GenerationRequest(f"packed-{i}", p, tokens) for i, p in enumerate(prompts)])
        for result, prompt in zip(results, prompts):
            assert result.tokens == without_eos(loaded, quantized_greedy(loaded, prompt, tokens, 8))
        second_prompt = prompts[0] + tuple(results[0].tokens) + raw_prompt(loaded, " And then?")[1:]
        second = run_turn(engine, GenerationRequest("packed-0", second_prompt, tokens))
        assert second.finish.usage.reused_tokens >= len(prompts[0])
        assert second.tokens == without_eos(loaded, quantized_greedy(loaded, second_prompt, tokens, 8))
        kinds = engine.call(lambda e: {type(layer).__name__ for layer in e.agents.get("packed-0").kv.layers}).result()
        assert "QuantizedFullKV" in kinds
    finally:
        engine.stop()


def test_smollm2s_packed_kv_decodes_on_the_cpus_host_step_with_mlxs_quantized_logits(smollm2) -> None:
    """--kv-bits 8 on the CPU backend: a decode step of agents whose K/V the pool packs runs whole on the host
    (the packed loops read the words in place and pack each step's own key and value), and its logits are those
    of MLX's forward over mlx-lm's quantized attention, step after step, fed the same tokens."""
    import numpy as np

    from engine.runtime.runner.backends.cpu import host_packed_decode
    from engine.runtime.runner.backends.cpu.backend import CpuBackend
    from engine.runtime.runner.backends.cpu.host_kv import HostQuantizedFullKV
    from engine.runtime.runner.kv.full_kv import KVShape
    from engine.runtime.runner.kv.quantized_kv import QuantizedFullKV

    model = smollm2.model
    attn = model.model.layers[0].self_attn
    shape = KVShape(attn.n_kv_heads, attn.head_dim, attn.head_dim, mx.float32, 8, 64)
    host_packed_decode.warm_up()
    backend = CpuBackend()
    backend.attach(model)
    try:
        def prefilled(kind: type, prompt: tuple[int, ...]):
            layers = [kind(shape, 16) for _ in model.model.layers]
            for layer in layers:
                layer.reserve(len(prompt) + 16)
            mx.eval(model(mx.array([prompt]), cache=layers))
            return layers

        class Row:  # what a decode step reads of a sequence's cache
            def __init__(self, layers) -> None:
                self.layers = layers

        def copied(layers):  # the very packed arrays, in MLX's kind of layer
            out = [QuantizedFullKV(shape, 16) for _ in layers]
            for mine, theirs in zip(out, layers):
                mine.reserve(theirs.offset + 16)
                mine.load(*theirs.positions(0, theirs.offset))
            return out

        prompts = prompts_for(smollm2, 3)
        host = [Row(prefilled(HostQuantizedFullKV, p)) for p in prompts]
        tokens = [p[-1] for p in prompts]
        for _ in range(6):
            reference = [copied(row.layers) for row in host]  # this step starts from the same packed K/V
            assert backend.steps_on_host(model, host)
            got = np.asarray(backend.decode(model, mx.array(tokens, dtype=mx.uint32), host))
            expected = np.concatenate([np.asarray(model(mx.array([[t]]), cache=layers)[:, -1, :])
                                       for t, layers in zip(tokens, reference)])
            # The step's own keys and values are packed from the host's sums, which round apart from MLX's: a value
            # at a bin's edge takes the neighbouring code (or a group's extreme moves its scale a little), and the
            # layers after it see that (measured: logits up to 0.04 apart on values of ~10, each own position's
            # values within a bin of MLX's; a wrong position or packing is off by far more).
            np.testing.assert_allclose(got, expected, rtol=1e-2, atol=0.1)
            assert (got.argmax(-1) == expected.argmax(-1)).all()
            for row, layers in zip(host, reference):
                for mine, theirs in zip(row.layers, layers):
                    at = mine.offset - 1
                    for held, ref in zip(mine.positions(at, at + 1), theirs.positions(at, at + 1)):
                        values, expected_values = (np.asarray(mx.dequantize(*p, group_size=64, bits=8))
                                                   for p in (held, ref))
                        bin_width = np.abs(np.asarray(ref[1])).max()
                        assert np.abs(values - expected_values).max() <= 2 * bin_width
            tokens = [int(t) for t in expected.argmax(-1)]
    finally:
        backend.detach(model)
        backend.close()


def test_smollm2_answers_paris(smollm2) -> None:
    engine = start_engine(smollm2)
    try:
        result = run_turn(engine, GenerationRequest("paris", chat_prompt(smollm2, QUESTIONS[0]), MAX_TOKENS))
        assert "Paris" in result.text
    finally:
        engine.stop()


def test_agents_starting_together_prefill_a_shared_system_prompt_once(smollm2) -> None:
    """Four agents sent at once with one ~650-token system prompt: one computes it, three share its blocks.

    Two whole 256-token blocks to share, and past the 512-token chunk the references resume from, so each
    reference prefills only its last ~140 tokens (a 940-token prompt cost ~7 s a reference here)."""
    rules = "\n".join(f"Rule {i}: functions in module m{i} stay short and need test t{i}." for i in range(31))
    system = [{"role": "system", "content": f"You are a coding agent.\n{rules}"}]
    prompts = [tuple(smollm2.tokenizer.apply_chat_template(system + [{"role": "user", "content": q}],
                                                           add_generation_prompt=True)) for q in QUESTIONS[:4]]
    engine = start_engine(smollm2)
    try:
        results = run_turns(engine, [GenerationRequest(f"fleet-{i}", p, 12) for i, p in enumerate(prompts)])
    finally:
        engine.stop()
    usages = [r.finish.usage for r in results]
    shared = [u for u in usages if u.reuse_source.startswith("shared:")]
    assert len(shared) == 3, [u.reuse_source for u in usages]
    whole_blocks = (len(prompts[0]) - 20) // 256 * 256
    assert all(u.reused_tokens >= whole_blocks for u in shared)
    for result, prompt in zip(results, prompts):
        expected = reference_greedy(smollm2.model, list(prompt), 12, set(smollm2.eos_token_ids))
        assert result.tokens == without_eos(smollm2, expected), smollm2.tokenizer.decode(result.tokens)
