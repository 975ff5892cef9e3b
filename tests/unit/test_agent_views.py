"""An agent is described once (AgentView): the agents API's models are built from it, tier and class names
match the engine's enums, and an agent in every tier the engine has (cool included) is served by the API."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import get_args

import httpx
import pytest

from engine.api.agents_schemas import AGENT_FIELDS, AgentDetailOut, AgentOut
from engine.api.app import create_app
from engine.domain.priority import AgentClass
from engine.runtime.engine_thread.snapshot import AgentView, ClassName, TierName
from engine.runtime.tiers.agents import Tier
from tests.support.router_app import make_service
from tests.unit.test_cool_tier import POOL_AGENTS, ask, engine_on, notes

pytestmark = pytest.mark.unit


def test_tier_and_class_names_are_the_engines() -> None:
    assert set(get_args(TierName)) == {tier.value for tier in Tier}
    assert set(get_args(ClassName)) == {kind.value for kind in AgentClass}


def test_the_api_models_take_every_published_field_of_the_view_with_its_description() -> None:
    documented = {f.name: f.metadata["doc"] for f in dataclasses.fields(AgentView)}
    assert set(AGENT_FIELDS) <= set(documented) and "agent_id" in AGENT_FIELDS and "history" not in AGENT_FIELDS
    for model in (AgentOut, AgentDetailOut):
        for name in AGENT_FIELDS:
            assert model.model_fields[name].description == documented[name], (model.__name__, name)
    assert set(AgentOut.model_fields) == {*AGENT_FIELDS, "model", "messages", "has_conversation"}
    assert set(AgentDetailOut.model_fields) == set(AgentOut.model_fields) | {"cache_history"}


async def test_a_cool_agent_is_served_by_the_agents_api(tmp_path: Path) -> None:
    """A real engine whose idle agents cooled (--kv-bits-at-rest 8): listing the agents and reading a cool one
    answer 200 with tier "cool" (the API's tier names once left cool out: a 500 for any cool agent)."""
    engine = engine_on(tmp_path / "store")
    try:
        for i in range(POOL_AGENTS + 2):
            ask(engine, f"a{i}", notes(i))
        app = create_app(make_service(tmp_path / "api", engine))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            listed = await client.get("/v1/agents")
            assert listed.status_code == 200, listed.text
            tiers = {agent["agent_id"]: agent["tier"] for agent in listed.json()["data"]}
            assert tiers["a0"] == "cool", tiers
            one = await client.get("/v1/agents/a0")
            assert one.status_code == 200, one.text
            assert one.json()["tier"] == "cool" and one.json()["cached_tokens"] > 0
    finally:
        engine.stop()


def test_a_view_takes_the_records_fields_by_name_and_computes_only_the_rest() -> None:
    """Every AgentView field is the record's field or property of the same name (an enum as its value) or one
    the snapshot computes (COMPUTED); on a real engine after a turn, the shared ones equal the record's."""
    from enum import Enum

    from engine.domain.requests import GenerationRequest
    from engine.runtime.engine_thread.engine import Engine
    from engine.runtime.engine_thread.snapshot_builder import COMPUTED, SHARED_WITH_RECORD
    from engine.runtime.engine_thread.sync_client import run_turn
    from engine.runtime.tiers.agents import AgentRecord
    from tests.support.byte_tokenizer import BOS
    from tests.support.engine_settings import engine_settings
    from tests.support.tiny_models import loaded_tiny

    assert set(SHARED_WITH_RECORD) | COMPUTED == {f.name for f in dataclasses.fields(AgentView)}
    assert all(hasattr(AgentRecord, name) for name in SHARED_WITH_RECORD)
    engine = Engine(loaded_tiny("llama"), engine_settings(64 << 20, 4, 32))
    engine.start()
    try:
        run_turn(engine, GenerationRequest("viewed", (BOS, *b"a view of the record"), 6))
        view = engine.fresh_snapshot().agent("viewed")
        record = engine.call(lambda e: {name: getattr(e.agents.get("viewed"), name) for name in SHARED_WITH_RECORD}
                             ).result()
    finally:
        engine.stop()
    assert view is not None and view.turns == 1 and view.tier == "hot" and view.cached_tokens > 0
    for name, value in record.items():
        assert getattr(view, name) == (value.value if isinstance(value, Enum) else value), name
