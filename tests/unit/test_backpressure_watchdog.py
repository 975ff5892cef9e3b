"""Backpressure and the watchdog (issue 13): a bounded queue, a queue timeout, and a stuck engine noticed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.api.app import create_app
from engine.errors import QueueFullError
from engine.runtime.scheduler.scheduler import sequence_batch_factory
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.engine_seams import EngineSeams
from tests.support.engine_settings import engine_settings
from engine.domain.requests import FinishEvent, FinishReason, GenerationRequest
from tests.support.router_app import make_service
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_engine_batching import prompt_for

pytestmark = pytest.mark.unit


class Gate:
    """A batch whose steps wait while the gate is closed: an MLX call that hangs; ``step_s``: a slow model."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.open = threading.Event()
        self.open.set()
        self.step_s = step_s

    def factory(self, loaded, limits, hooks):
        batch = sequence_batch_factory(loaded, limits, hooks)
        step = batch.step

        def gated_step(plan, room):
            self.open.wait()
            time.sleep(self.step_s)
            return step(plan, room)

        batch.step = gated_step
        return batch


def engine_with(gate: Gate, **config) -> Engine:
    loaded = loaded_tiny("llama")
    engine = Engine(loaded, engine_settings(64 << 20, 2, 32, **config), seams=EngineSeams(batch_factory=gate.factory))
    engine.start()
    return engine


def test_beyond_the_queue_bound_a_request_is_refused_with_retry_after() -> None:
    gate = Gate()
    engine = engine_with(gate, max_queued_requests=3)
    try:
        gate.open.clear()
        run_turn_async = [engine.submit(GenerationRequest(f"a{i}", prompt_for(i), 4), lambda e: None)
                          for i in range(3)]
        assert len(run_turn_async) == 3
        time.sleep(0.2)  # the engine took what it could before the gate
        with pytest.raises(QueueFullError) as refused:
            for i in range(3, 10):
                engine.submit(GenerationRequest(f"a{i}", prompt_for(i), 4), lambda e: None)
        assert refused.value.retry_after_s >= 1
    finally:
        gate.open.set()
        engine.stop()


async def test_the_http_answer_to_a_full_queue_is_429_in_each_protocols_shape(tmp_path: Path) -> None:
    gate = Gate()
    engine = engine_with(gate, max_queued_requests=1)
    app = create_app(make_service(tmp_path, engine))  # type: ignore[arg-type]
    try:
        gate.open.clear()
        engine.submit(GenerationRequest("first", prompt_for(0), 4), lambda e: None)
        time.sleep(0.2)  # the engine took what it could before the gate
        with pytest.raises(QueueFullError):  # the queue is full however many the engine took
            for i in range(1, 10):
                engine.submit(GenerationRequest(f"more-{i}", prompt_for(i), 4), lambda e: None)
        # (a timeout: a request let through would wait on the closed gate for ever)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t", timeout=30) as client:
            body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            anthropic = await client.post("/v1/messages", json=body)
            openai = await client.post("/v1/chat/completions", json={"messages": body["messages"]})
        assert anthropic.status_code == 429 and anthropic.headers["retry-after"]
        assert anthropic.json()["error"]["type"] == "rate_limit_error"
        assert openai.status_code == 429 and openai.headers["retry-after"]
        assert openai.json()["error"]["type"] == "rate_limit_error"
    finally:
        gate.open.set()
        engine.stop()


def test_a_request_that_waited_past_the_queue_timeout_is_refused_as_overloaded() -> None:
    gate = Gate(step_s=0.005)  # the two long turns hold the batch for ~2 s however fast the tiny model decodes
    engine = engine_with(gate, request_timeout_s=0.3)
    finished: list[FinishEvent] = []
    done = threading.Event()

    def sink(event) -> None:
        if isinstance(event, FinishEvent):
            finished.append(event)
            done.set()

    try:
        long = engine.submit(GenerationRequest("busy-1", prompt_for(0, 3), 400), lambda e: None)
        engine.submit(GenerationRequest("busy-2", prompt_for(1, 3), 400), lambda e: None)
        engine.submit(GenerationRequest("waits", prompt_for(2), 4), sink)  # the batch (2) is full
        assert done.wait(30)
        assert finished[0].reason is FinishReason.ERROR and finished[0].error_type == "overloaded"
        assert "waited" in (finished[0].error or "")
        assert long
    finally:
        engine.stop(0.0)


async def test_a_stuck_engine_turns_readiness_off_with_the_reason_and_back_on(tmp_path: Path) -> None:
    gate = Gate()
    engine = engine_with(gate, watchdog_s=0.3)
    service = make_service(tmp_path, engine)  # type: ignore[arg-type]
    app = create_app(service)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            assert (await client.get("/health/ready")).status_code == 200
            gate.open.clear()
            engine.submit(GenerationRequest("stuck", prompt_for(0), 8), lambda e: None)
            time.sleep(0.8)
            ready = await client.get("/health/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "stalled"
            assert "no step for" in ready.json()["detail"]
            metrics = (await client.get("/metrics")).text
            assert "semantic_engine_stalls_total 1.0" in metrics
            assert (await client.get("/health/live")).status_code == 200  # the process still answers
            gate.open.set()
            for _ in range(50):
                if (await client.get("/health/ready")).status_code == 200:
                    break
                time.sleep(0.1)
            assert (await client.get("/health/ready")).status_code == 200
            assert any("engine stalled" in e.message for e in service.events.since(0))
    finally:
        gate.open.set()
        engine.stop()
