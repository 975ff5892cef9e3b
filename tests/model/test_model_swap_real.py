"""Hot-swap on the real models: SmolLM2 -> Gemma 3 270M -> SmolLM2 keeps every agent's cache."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from engine.api.service import EngineService
from engine.bootstrap import build_engine, engine_builder, load_configured_model
from engine.errors import ModelLoadError
from engine.domain.requests import FinishReason, GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn, run_turns, stream_turn
from engine.settings import load_settings
from engine.swap import SwapPhase, memory_reading

QUESTIONS = {"ann": "What is the capital of France?", "bob": "Name a primary colour."}


@pytest.fixture(scope="module")
def service(smollm2_path: Path, tmp_path_factory) -> EngineService:
    settings = load_settings(cache_dir=tmp_path_factory.mktemp("swap"), model=str(smollm2_path),
                             pool_budget_mb=512, preload_openblas=False, swap_grace_s=5)
    loaded = load_configured_model(settings)
    svc = EngineService(settings, None)
    engine = build_engine(settings, loaded, svc.events)
    engine.start()
    svc.attach(engine)
    svc.enable_swaps(engine_builder(settings, svc.events))
    svc.fresh_start_memory = memory_reading()["mlx_active"]
    del loaded, engine  # only the service may hold the model, or a swap cannot free it
    yield svc
    svc.engine.stop(0)


def chat(service: EngineService, history: list[dict]) -> tuple[int, ...]:
    return tuple(service.engine.loaded.tokenizer.apply_chat_template(history, add_generation_prompt=True))


def swap(service: EngineService, ref: str):
    service.swapper.request(ref, grace_s=5)
    return service.swapper.wait(600)


def test_agents_continue_with_restored_caches_after_swapping_away_and_back(service, smollm2_path, gemma3_path) -> None:
    histories = {}
    for agent, question in QUESTIONS.items():
        first = run_turn(service.engine, GenerationRequest(agent, chat(service, [{"role": "user", "content": question}]), 16))
        histories[agent] = [{"role": "user", "content": question}, {"role": "assistant", "content": first.text},
                            {"role": "user", "content": "Tell me more."}]
    # What turn 2 says without any swap: the same prompts on twin agents.
    twins = run_turns(service.engine, [GenerationRequest(f"{a}-twin", chat(service, h), 16) for a, h in histories.items()])
    away = swap(service, str(gemma3_path))
    assert away.phase is SwapPhase.DONE, away.error
    assert service.engine.loaded.architecture == "gemma3_text"
    assert service.engine.fresh_snapshot().agent("ann").tier in ("empty", "cold")  # identity kept, no gemma cache
    back = swap(service, str(smollm2_path))
    assert back.phase is SwapPhase.DONE, back.error
    snapshot = service.engine.fresh_snapshot()
    assert {snapshot.agent(a).tier for a in QUESTIONS} == {"warm"}
    seconds = run_turns(service.engine, [GenerationRequest(a, chat(service, h), 16) for a, h in histories.items()])
    for result, twin in zip(seconds, twins):
        assert result.finish.usage.reused_tokens > 0
        assert result.tokens == twin.tokens
    # EXP-011: memory after a round trip is that of a fresh start on the same model.
    assert abs(back.memory["after"] - service.fresh_start_memory) <= 0.05 * service.fresh_start_memory, back.memory


def test_swap_while_decoding_cancels_in_flight_requests_cleanly(service, smollm2_path) -> None:
    prompt = chat(service, [{"role": "user", "content": "Write a very long story about the sea."}])
    events, finished = [], threading.Event()

    def consume() -> None:
        for event in stream_turn(service.engine, GenerationRequest("long", prompt, 2000), timeout_s=600):
            events.append(event)
        finished.set()

    threading.Thread(target=consume, daemon=True).start()
    while not any(type(e).__name__ == "TokenEvent" for e in events):
        finished.wait(0.05)
    service.swapper.request(str(smollm2_path), grace_s=0.5)
    status = service.swapper.wait(600)
    assert finished.wait(60)
    assert status.phase is SwapPhase.DONE and status.cancelled_requests >= 1
    assert events[-1].reason is FinishReason.CANCELLED


def test_swap_to_a_corrupt_model_leaves_the_old_one_serving(service, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    before = service.engine.loaded.identity
    status = swap(service, str(broken))
    assert status.phase is SwapPhase.FAILED and status.error
    assert service.engine.loaded.identity == before
    result = run_turn(service.engine, GenerationRequest("after-fail", chat(service, [{"role": "user", "content": "Hi"}]), 4))
    assert result.finish.error is None
    with pytest.raises(ModelLoadError):
        service.registry.add(str(tmp_path / "missing-model"))
