"""The CPU's fast softmax, SiLU and GELU on the real models: long prompts, batched, token-identical to mlx-lm.

Prompts of ~1,100 tokens put every path of the CPU backend (``backends/cpu/``) to work in
the engine: prefill chunks of 512 queries (over 512 and ~1K keys) take their softmax in
compiled rows (``host_softmax``), the last, shorter chunk ``cpu_math``'s attention, and
each decode row's scores (heads x ~1.1K) are past ``MIN_ELEMENTS``; SmolLM2's
MLP goes through the fast SiLU, Gemma 3's through the fast GELU. The
reference is plain mlx-lm (``generate_step``) on the same model object,
outside the engine's forward passes, so it runs MLX's own kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import mlx.core as mx

from engine.runtime.runner.backends.cpu import cpu_math, host_decode, host_forward, host_softmax
from engine.runtime.runner.backends.cpu.backend import CpuBackend
from engine.domain.requests import GenerationRequest
from engine.settings import SchedulingSettings
from engine.runtime.engine_thread.sync_client import run_turns
from tests.model.engine_fixtures import start_engine
from tests.support.reference import reference_greedy
from tests.support.warm_ups import wait_for_warm_ups

pytestmark = pytest.mark.model

# Enough decode steps to run each decode path many times; each Gemma 3 token of the plain mlx-lm reference
# costs ~0.35 s here.
MAX_TOKENS = 12
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def long_prompts(loaded, n: int, tokens: int = 1100) -> list[list[int]]:
    """``n`` prompts of about ``tokens`` tokens: different stretches of the README, then a request."""
    words = README.split()
    prompts = []
    for i in range(n):
        text = " ".join(words[i * 40:])
        ids = loaded.tokenizer.encode(text)[:tokens]
        excerpt = loaded.tokenizer.decode(ids)
        if loaded.architecture == "llama":
            messages = [{"role": "user", "content": excerpt + "\n\nSummarize the text above in one sentence."}]
            prompts.append(list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
        else:
            prompts.append(list(loaded.tokenizer.encode(excerpt + "\n\nIn one sentence, the text above says that")))
    return prompts


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_long_prompts_batched_through_the_fast_paths_equal_mlx_lm(request, model_name: str, monkeypatch) -> None:
    loaded = request.getfixturevalue(model_name)
    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the fast paths are for the CPU")
    calls = {"rows": 0, "kernel": 0, "swiglu": 0, "gelu_approx": 0, "host_decode": 0, "host_forward": 0}
    rows, kernel, host, forward = host_softmax.attention, cpu_math._attention, host_decode.attend_host, host_forward.decode
    activations = {name: getattr(cpu_math, name) for name in ("swiglu", "gelu_approx")}

    def counting(name: str):
        def counted(*args, **kwargs):
            calls[name] += 1
            return activations[name](*args, **kwargs)
        return counted

    def counting_rows(*args, **kwargs):
        calls["rows"] += 1
        return rows(*args, **kwargs)

    def counting_kernel(*args, **kwargs):
        calls["kernel"] += 1
        return kernel(*args, **kwargs)

    def counting_host(*args, **kwargs):
        calls["host_decode"] += 1
        return host(*args, **kwargs)

    def counting_forward(*args, **kwargs):
        calls["host_forward"] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(host_decode, "attend_host", counting_host)
    monkeypatch.setattr(host_forward, "decode", counting_forward)
    monkeypatch.setattr(host_softmax, "attention", counting_rows)
    monkeypatch.setattr(cpu_math, "_attention", counting_kernel)
    for name in activations:
        monkeypatch.setattr(cpu_math, name, counting(name))
    prompts = long_prompts(loaded, 2)
    # Whole 512-token chunks (no pacing beside a decoding row), so the two rows decode together: this test is
    # about the CPU's paths, not about the pacer.
    engine = start_engine(loaded, batch=8, prefill_step=512, scheduling=SchedulingSettings(decode_gap_ms=0))
    try:
        assert isinstance(engine.backend, CpuBackend)
        wait_for_warm_ups()  # the compiled loops load in the background; the turns below should find them
        results = run_turns(engine, [GenerationRequest(f"long-{i}", tuple(p), MAX_TOKENS)
                                     for i, p in enumerate(prompts)])
    finally:
        engine.stop()
    assert calls["rows"] > 0 and calls["kernel"] > 0, calls
    activation = "swiglu" if model_name == "smollm2" else "gelu_approx"
    assert calls[activation] > 0, calls
    # The two rows decode together: their attention ran in host_decode's compiled loops, both layer kinds for Gemma;
    # SmolLM2's whole decode step ran on the host (host_forward), Gemma's sliding windows keep MLX's forward.
    assert calls["host_decode"] >= (MAX_TOKENS - 2) * len(loaded.model.layers) // 2, calls
    if model_name == "smollm2":
        assert calls["host_forward"] >= MAX_TOKENS - 2, calls
    else:
        assert calls["host_forward"] == 0, calls
    before = dict(calls)
    eos = set(loaded.eos_token_ids)
    for result, prompt in zip(results, prompts):
        expected = reference_greedy(loaded.model, prompt, MAX_TOKENS, eos)
        expected = expected[:-1] if expected and expected[-1] in eos else expected
        assert result.tokens == expected, loaded.tokenizer.decode(result.tokens)
    assert calls == before  # the reference ran MLX's kernels, not these
