"""An attached workbench's snapshot, rebuilt from a stats frame, is the engine's own, field for field.

A real engine on a tiny random-weight llama serves two agents over HTTP (one
of them twice, so it has a cache history); its published snapshot then goes
through ``build_stats`` and JSON, as a ``/v1/stream`` frame does, and back. A
snapshot field that the stats drop or rename fails the comparison, so the two
workbenches cannot drift apart unnoticed.
"""

from __future__ import annotations

import json
import time
from dataclasses import fields, replace

import httpx
import pytest

from engine.api.admin_routes import build_stats
from engine.api.app import create_app
from engine.runtime.engine_thread.engine import Engine
from semantic_tui.stats_snapshot import snapshot_from_stats
from tests.support.engine_settings import engine_settings
from tests.support.router_app import LiveServer, make_service
from tests.support.tiny_models import loaded_tiny


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = Engine(loaded_tiny("llama", block_tokens=16), engine_settings(64 * 2**20, 8, 32))
    engine.start()
    service = make_service(tmp_path_factory.mktemp("stats-snapshot"), engine)
    try:
        with LiveServer(create_app(service)) as live:
            yield service, live.url
    finally:
        engine.stop(0.0)


def turn(url: str, agent: str, text: str, history: list[dict]) -> list[dict]:
    messages = [*history, {"role": "user", "content": text}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "session_id": agent}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    return [*messages, reply["choices"][0]["message"]]


def published_with(service, agents: set[str], timeout_s: float = 30.0):
    """The engine's published snapshot once it lists ``agents`` (it publishes after a reply has gone out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snapshot = service.snapshot()
        if snapshot is not None and {a.agent_id for a in snapshot.agents} >= agents:
            return snapshot
        assert time.monotonic() < deadline, f"the engine never published a snapshot with {sorted(agents)}"
        time.sleep(0.02)


def test_a_live_engines_snapshot_survives_the_stats_round_trip(served, monkeypatch) -> None:
    service, url = served
    history = turn(url, "rt-one", "Count from one to five.", [])
    turn(url, "rt-one", "And back down to one.", history)
    turn(url, "rt-two", "Name a colour.", [])
    published = published_with(service, {"oa-rt-one", "oa-rt-two"})
    assert published.agent("oa-rt-one").history and published.pool.used_blocks > 0
    monkeypatch.setattr(service, "snapshot", lambda: published)  # the engine may publish again meanwhile

    wire = json.loads(build_stats(service, with_blocks=True).model_dump_json())
    rebuilt = snapshot_from_stats(wire)

    # The stats add the process's BLAS to the backend's own description; everything else is the engine's.
    assert published.backend.items() <= rebuilt.backend.items()
    for field in fields(published):
        if field.name != "backend":
            assert getattr(rebuilt, field.name) == getattr(published, field.name), field.name
    assert rebuilt == replace(published, backend=rebuilt.backend)


def test_stats_without_the_block_map_rebuild_the_pool_counts(served) -> None:
    service, _url = served
    published = service.snapshot()
    rebuilt = snapshot_from_stats(json.loads(build_stats(service).model_dump_json()))
    assert rebuilt.pool.used_blocks == published.pool.used_blocks
    assert dict(rebuilt.pool.owner_blocks) == dict(published.pool.owner_blocks)
    assert rebuilt.pool.block_owner == ()
