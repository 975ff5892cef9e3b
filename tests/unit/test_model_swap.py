"""Model hot-swap protocol with scripted engines: phases, waiting requests, rollback, idle unload."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.api.app import create_app
from engine.api.service import EngineService
from engine.errors import EngineUnavailableError, ModelLoadError
from engine.domain.requests import FinishEvent, GenerationRequest
from engine.settings import load_settings
from engine.swap import SwapPhase
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded


class Builds:
    """Engine builder for swaps: records calls; fails or stalls on demand."""

    def __init__(self, fail: set[str] = frozenset(), delay_s: float = 0.0) -> None:
        self.fail = set(fail)
        self.delay_s = delay_s
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.release = threading.Event()
        self.release.set()

    def __call__(self, ref, progress, seeds):
        self.calls.append((ref, tuple(s.agent_id for s in seeds)))
        self.release.wait(30)
        time.sleep(self.delay_s)
        if ref in self.fail:
            raise ModelLoadError(f"could not load model folder {ref}: corrupt weights")
        return ScriptedEngine(lambda r, ref=ref: f"I am {ref}", loaded=scripted_loaded(name=ref))


def make(tmp_path: Path, builds: Builds, **settings) -> EngineService:
    config = load_settings(cache_dir=tmp_path, model="alpha", preload_openblas=False, **settings)
    service = EngineService(config, ScriptedEngine(lambda r: "I am alpha", loaded=scripted_loaded(name="alpha")))
    service.enable_swaps(builds)
    return service


def finish_of(engine, agent: str) -> FinishEvent:
    done: list[FinishEvent] = []
    event = threading.Event()
    engine.submit(GenerationRequest(agent, tuple(b"hello"), 8), lambda e: (done.append(e), event.set()) if isinstance(e, FinishEvent) else None)
    event.wait(10)
    return done[0]


def test_swap_runs_every_phase_and_keeps_agent_identities(tmp_path: Path) -> None:
    builds = Builds()
    service = make(tmp_path, builds)
    finish_of(service.engine, "agent-a")
    old = service.engine
    status = service.swapper.request("beta", grace_s=1.0)
    assert status.running
    status = service.swapper.wait(10)
    assert status.phase is SwapPhase.DONE, status.error
    assert set(status.seconds) >= {"draining", "spilling", "unloading", "loading", "rebuilding"}
    assert not old.is_running and service.engine.loaded.model_id == "beta"
    assert builds.calls == [("beta", ("agent-a",))]
    assert status.spilled_agents == 1 and status.from_model == "alpha" and status.to_model == "beta"
    assert service.registry.loaded.model_id == "beta"


def test_failed_load_rolls_back_to_the_previous_model(tmp_path: Path) -> None:
    builds = Builds(fail={"broken"})
    service = make(tmp_path, builds)
    service.swapper.request("broken", grace_s=0)
    status = service.swapper.wait(10)
    assert status.phase is SwapPhase.FAILED
    assert "corrupt weights" in status.error
    assert service.is_ready and service.engine.loaded.model_id == "alpha"
    assert [ref for ref, _ in builds.calls] == ["broken", "alpha"]
    assert any("swap to broken failed" in e.message for e in service.events.since(0))


def test_only_one_swap_at_a_time(tmp_path: Path) -> None:
    builds = Builds()
    builds.release.clear()
    service = make(tmp_path, builds)
    service.swapper.request("beta", 0)
    with pytest.raises(EngineUnavailableError, match="already running"):
        service.swapper.request("gamma", 0)
    builds.release.set()
    assert service.swapper.wait(10).phase is SwapPhase.DONE


async def test_requests_wait_for_a_swap_then_run_on_the_new_model(tmp_path: Path) -> None:
    builds = Builds(delay_s=0.3)
    service = make(tmp_path, builds)
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "who are you"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service)), base_url="http://t") as client:
        service.swapper.request("beta", 0)
        response = await client.post("/v1/messages", json=body)
        progress = (await client.get("/v1/admin/swap")).json()
    assert response.status_code == 200
    assert response.json()["content"][0]["text"] == "I am beta"
    assert progress["phase"] == "done" and progress["to_model"] == "beta"


async def test_a_swap_longer_than_swap_wait_answers_503_with_retry_after(tmp_path: Path) -> None:
    builds = Builds()
    builds.release.clear()
    service = make(tmp_path, builds, swap_wait_s=0.2)
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service)), base_url="http://t") as client:
        service.swapper.request("beta", 0)
        response = await client.post("/v1/chat/completions", json=body)
    builds.release.set()
    service.swapper.wait(10)
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) > 0
    assert "swapping model to beta" in response.json()["error"]["message"]


async def test_swap_endpoint_validates_and_reports(tmp_path: Path) -> None:
    service = make(tmp_path, Builds())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service)), base_url="http://t") as client:
        missing = await client.post("/v1/admin/swap", json={"model": "/no/such/folder"})
        bad = await client.post("/v1/admin/swap", json={"model": ""})
        started = await client.post("/v1/admin/swap", json={"model": "beta", "grace_s": 0})
        service.swapper.wait(10)
        done = await client.get("/v1/admin/swap")
        models = (await client.get("/v1/models")).json()
    assert missing.status_code == 400 and "not found" in missing.json()["error"]["message"]
    assert bad.status_code == 400
    assert started.status_code == 202 and started.json()["to_model"] == "beta"
    assert done.json()["phase"] == "done"
    assert models["data"][0]["id"] == "beta" and models["data"][0]["loaded"] is True


async def test_request_model_field_swaps_only_when_allowed(tmp_path: Path) -> None:
    for allowed, expected in ((False, "I am alpha"), (True, "I am beta")):
        builds = Builds()
        service = make(tmp_path / str(allowed), builds, allow_model_swap_by_request=allowed)
        (tmp_path / "config.json").write_text("{}")  # a folder with a config.json is a model folder
        service.registry.add(str(tmp_path))
        service.registry._extra["beta"] = service.registry._extra[str(tmp_path)].__class__("beta", "hub", "beta")
        body = {"model": "beta", "max_tokens": 16, "messages": [{"role": "user", "content": "who"}]}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service)), base_url="http://t") as client:
            response = await client.post("/v1/messages", json=body)
        assert response.json()["content"][0]["text"] == expected


async def test_idle_unload_then_reload_on_the_next_request(tmp_path: Path) -> None:
    builds = Builds()
    service = make(tmp_path, builds)
    service.swapper.unload(0.0, "idle for 600 s")
    assert service.swapper.status.phase is SwapPhase.UNLOADED and not service.is_ready
    await service.wait_ready()
    assert service.is_ready and service.engine.loaded.model_id == "alpha"
    assert builds.calls[-1][0] == "alpha"


def test_idle_monitor_unloads_after_the_configured_time(tmp_path: Path) -> None:
    service = make(tmp_path, Builds(), idle_unload_s=0.2)
    deadline = time.monotonic() + 10
    while service.swapper.status.phase is not SwapPhase.UNLOADED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.swapper.status.phase is SwapPhase.UNLOADED
    assert any("unloaded (idle for" in e.message for e in service.events.since(0))


async def test_a_request_during_an_idle_unload_reloads_the_model_without_another_request(tmp_path: Path) -> None:
    builds = Builds()
    service = make(tmp_path, builds, swap_wait_s=20)
    engine = service.detachable_engine()
    release = threading.Event()
    stop = engine.stop

    def slow_stop(grace_s: float = 10.0) -> None:
        release.wait(10)  # the unload is still spilling when the request arrives
        stop(grace_s)

    engine.stop = slow_stop
    unloading = threading.Thread(target=service.swapper.unload, args=(0.0, "idle for 600 s"))
    unloading.start()
    deadline = time.monotonic() + 5
    while service.swapper.status.phase is not SwapPhase.SPILLING and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting = asyncio.ensure_future(service.wait_ready())
    await asyncio.sleep(0.1)
    release.set()
    started = time.monotonic()
    await asyncio.wait_for(waiting, 15)  # before the fix: swap_wait_s (20 s), then a 503
    unloading.join(10)
    assert service.is_ready and time.monotonic() - started < 10
    assert builds.calls[-1][0] == "alpha"
