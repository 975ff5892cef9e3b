"""Admin, health, models and metrics endpoints, and the cross-cutting HTTP
behaviour (auth, body limit, error shapes), against a ScriptedEngine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

import anthropic
import httpx
import httpx2
import openai
import pytest
from fastapi import FastAPI

from engine.api.app import create_app
from engine.api.service import EngineService
from engine.models.packaged import PACKAGED_MODELS
from tests.support.router_app import make_service
from tests.support.scripted_engine import ScriptedEngine, scripted_loaded

BASE = "http://semantic.test"
SESSION = {"x-claude-code-session-id": "5f0c9a4e-0000-4000-8000-000000000001"}
JSON = {"content-type": "application/json"}


def client_for(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)


def sdk_http(app: FastAPI) -> httpx2.AsyncClient:
    """The anthropic and openai SDKs run on httpx2 and reject httpx clients."""
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE)


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def service(tmp_path: Path, engine: ScriptedEngine) -> EngineService:
    return make_service(tmp_path, engine)


@pytest.fixture
async def client(service: EngineService) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(create_app(service)) as c:
        yield c


async def one_turn(client: httpx.AsyncClient, text: str = "hi", headers: dict[str, str] = SESSION) -> httpx.Response:
    body = {"model": "claude-opus-5-5", "max_tokens": 64, "messages": [{"role": "user", "content": text}]}
    response = await client.post("/v1/messages", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert body["error"]["message"]
    return body


def assert_openai_error(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- stats ------------------------------------------------------------------------------------


async def test_stats_describe_model_pool_tiers_agents_and_backend(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    await one_turn(client)
    stats = (await client.get("/v1/stats")).json()

    assert stats["status"] == "ready"
    assert stats["model"] == {
        "model_id": "scripted", "identity": engine.loaded.identity.key, "path": None, "architecture": "scripted",
        "context_length": 4096, "cache_spec": engine.loaded.spec.describe(),
        "sampling_defaults": "temperature 0.7, top_p 0.95, top_k 40 (fallback: no generation_config.json)",
        "speculation": "off", "vision": "no: it is a text model", "hot_kv": "full precision",
    }
    pool = stats["pool"]
    (agent,) = stats["agents"]
    assert pool["used_blocks"] == agent["blocks"] > 0
    assert pool["free_blocks"] == pool["total_blocks"] - pool["used_blocks"] == 256 - agent["blocks"]
    assert pool["used_bytes"] == pool["used_blocks"] * pool["block_bytes"]
    assert pool["pressure"] == pytest.approx(pool["used_blocks"] / 256)
    assert pool["owner_blocks"] == {agent["agent_id"]: agent["blocks"]}
    assert pool["block_map"] is None
    assert agent["tier"] == "hot" and agent["state"] == "idle" and agent["turns"] == 1
    assert stats["tiers"]["hot_agents"] == 1 and stats["throughput"]["requests_total"] == 1
    assert {"backend", "blas", "library", "source"} <= set(stats["backend"])


async def test_stats_block_map_only_on_request(client: httpx.AsyncClient) -> None:
    await one_turn(client)
    pool = (await client.get("/v1/stats", params={"blocks": "true"})).json()["pool"]
    owners, groups = pool["block_map"]["owners"], pool["block_map"]["groups"]
    assert len(owners) == len(groups) == pool["total_blocks"]
    (agent_id,) = pool["owner_blocks"]
    assert owners.count(agent_id) == pool["used_blocks"]
    assert owners.count(None) == pool["free_blocks"]


async def test_stats_without_an_engine_report_the_loading_state(tmp_path: Path) -> None:
    service = EngineService(make_service(tmp_path).settings, None)
    service.status_detail = "loading the model"
    async with client_for(create_app(service)) as c:
        stats = (await c.get("/v1/stats")).json()
    assert stats["status"] == "starting" and stats["detail"] == "loading the model"
    assert stats["model"] is None and stats["pool"] is None and stats["agents"] == []


# -- evict-idle -------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["warm", "cold"])
async def test_evict_idle_moves_idle_agents_out_of_the_pool(client: httpx.AsyncClient, tier: str) -> None:
    await one_turn(client)
    await one_turn(client, headers={"x-claude-code-session-id": "another-session"})

    assert (await client.post("/v1/admin/evict-idle", json={"tier": tier})).json() == {"evicted": 2}
    stats = (await client.get("/v1/stats")).json()
    assert [a["tier"] for a in stats["agents"]] == [tier, tier]
    assert stats["pool"]["used_blocks"] == 0
    assert (await client.post("/v1/admin/evict-idle", json={"tier": tier})).json() == {"evicted": 0}


async def test_evict_idle_defaults_to_warm_and_rejects_other_tiers(client: httpx.AsyncClient) -> None:
    await one_turn(client)
    assert (await client.post("/v1/admin/evict-idle")).json() == {"evicted": 1}
    assert (await client.get("/v1/stats")).json()["agents"][0]["tier"] == "warm"
    rejected = await client.post("/v1/admin/evict-idle", json={"tier": "hot"})
    body = assert_anthropic_error(rejected, 400, "invalid_request_error")
    assert "tier" in body["error"]["message"]


async def test_evict_idle_is_503_when_the_engine_has_stopped(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.stop()
    response = await client.post("/v1/admin/evict-idle", json={"tier": "warm"})
    assert_anthropic_error(response, 503, "overloaded_error")
    assert response.headers["retry-after"] == "5"


# -- health -----------------------------------------------------------------------------------


async def test_health_ready_flips_when_the_engine_stops(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    ready = await client.get("/health/ready")
    assert ready.status_code == 200
    identity = engine.loaded.identity.key
    assert ready.json() == {"status": "ready", "model": "scripted", "identity": identity, "detail": None}

    engine.stop()
    ready = await client.get("/health/ready")
    assert ready.status_code == 503 and ready.headers["retry-after"] == "5"
    assert ready.json()["status"] == "stopped" and ready.json()["detail"] == "the engine has stopped"
    assert (await client.get("/health/live")).json() == {"status": "ok"}


async def test_health_while_the_model_loads(tmp_path: Path) -> None:
    service = EngineService(make_service(tmp_path).settings, None)
    service.status_detail = "loading the model"
    async with client_for(create_app(service)) as c:
        live, ready = await c.get("/health/live"), await c.get("/health/ready")
        assert live.status_code == 200
        assert ready.status_code == 503 and ready.headers["retry-after"] == "5"
        assert ready.json() == {"status": "starting", "model": None, "identity": None, "detail": "loading the model"}

        service.attach(ScriptedEngine())
        service.status_detail = None
        assert (await c.get("/health/ready")).status_code == 200


# -- models -----------------------------------------------------------------------------------


async def test_models_list_parses_with_the_anthropic_sdk(service: EngineService) -> None:
    async with sdk_http(create_app(service)) as http:
        sdk = anthropic.AsyncAnthropic(api_key="unused", base_url=BASE, http_client=http)
        page = await sdk.models.list(limit=1000)
        models = [m async for m in page]
        one = await sdk.models.retrieve("scripted")
        with pytest.raises(anthropic.NotFoundError) as missing:
            await sdk.models.retrieve("claude-nonexistent")

    assert [m.id for m in models] == ["scripted", *(m.alias for m in PACKAGED_MODELS)]
    assert all(m.type == "model" and m.display_name for m in models)
    assert models[0].created_at.isoformat() == "2026-01-01T00:00:00+00:00"
    assert page.has_more is False and page.first_id == "scripted" and page.last_id == PACKAGED_MODELS[-1].alias
    assert one.id == "scripted" and one.max_input_tokens == 4096
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


async def test_models_list_parses_with_the_openai_sdk(service: EngineService) -> None:
    async with sdk_http(create_app(service)) as http:
        sdk = openai.AsyncOpenAI(api_key="unused", base_url=f"{BASE}/v1", http_client=http)
        models = [m async for m in sdk.models.list()]
        one = await sdk.models.retrieve("smollm2-135m")
        with pytest.raises(openai.NotFoundError) as missing:
            await sdk.models.retrieve("gpt-nonexistent")

    assert [m.id for m in models] == ["scripted", *(m.alias for m in PACKAGED_MODELS)]
    assert all(m.object == "model" and m.owned_by == "semantic" and m.created == 1767225600 for m in models)
    assert one.id == "smollm2-135m"
    assert missing.value.body["type"] == "invalid_request_error"  # type: ignore[index]


async def test_models_mark_which_one_is_loaded(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    listing = (await client.get("/v1/models", params={"limit": 1, "after_id": "x"})).json()
    assert listing["object"] == "list" and listing["has_more"] is False
    loaded = [m for m in listing["data"] if m["loaded"]]
    assert [m["id"] for m in loaded] == ["scripted"] and loaded[0]["identity"] == engine.loaded.identity.key
    assert all(m["identity"] is None for m in listing["data"] if not m["loaded"])
    by_identity = await client.get(f"/v1/models/{engine.loaded.identity.key}")
    assert by_identity.json()["id"] == "scripted"
    assert (await client.get("/v1/models/SmolLM2")).json()["id"] == "smollm2-135m"


async def test_a_loaded_packaged_model_is_listed_once(tmp_path: Path) -> None:
    engine = ScriptedEngine(loaded=replace(scripted_loaded(), model_id="smollm2-135m"))
    async with client_for(create_app(make_service(tmp_path, engine))) as c:
        data = (await c.get("/v1/models")).json()["data"]
    assert [(m["id"], m["loaded"]) for m in data] == [("smollm2-135m", True), ("gemma3-270m", False)]
    assert data[0]["display_name"] == "SmolLM2 135M Instruct"


async def test_models_without_an_engine_list_only_packaged_models(tmp_path: Path) -> None:
    service = EngineService(make_service(tmp_path).settings, None)
    async with client_for(create_app(service)) as c:
        data = (await c.get("/v1/models")).json()["data"]
    assert [m["id"] for m in data] == [m.alias for m in PACKAGED_MODELS] and not any(m["loaded"] for m in data)


# -- auth -------------------------------------------------------------------------------------


@pytest.fixture
async def keyed(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(create_app(make_service(tmp_path, ScriptedEngine(), api_key="s3cret"))) as c:
        yield c


async def test_api_key_accepted_as_x_api_key_or_bearer(keyed: httpx.AsyncClient) -> None:
    assert (await keyed.get("/v1/stats", headers={"x-api-key": "s3cret"})).status_code == 200
    assert (await keyed.get("/v1/stats", headers={"authorization": "Bearer s3cret"})).status_code == 200
    assert (await keyed.get("/v1/models", headers={"authorization": "bearer s3cret"})).status_code == 200


async def test_missing_or_wrong_key_is_401_in_the_protocol_shape(keyed: httpx.AsyncClient) -> None:
    assert_anthropic_error(await keyed.get("/v1/stats"), 401, "authentication_error")
    wrong = await keyed.post("/v1/messages", json={}, headers={"x-api-key": "nope"})
    assert_anthropic_error(wrong, 401, "authentication_error")
    assert_anthropic_error(await keyed.post("/v1/admin/evict-idle", headers={"authorization": "Bearer nope"}),
                           401, "authentication_error")
    assert_openai_error(await keyed.post("/v1/chat/completions", json={}, headers={"authorization": "Bearer nope"}),
                        401, "authentication_error")


async def test_health_probes_need_no_key(keyed: httpx.AsyncClient) -> None:
    assert (await keyed.get("/health/live")).status_code == 200
    assert (await keyed.get("/health/ready")).status_code == 200


# -- body limit, unknown routes, malformed JSON -------------------------------------------------


@pytest.fixture
async def small_body(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(create_app(make_service(tmp_path, ScriptedEngine(), max_body_mb=0.001))) as c:
        yield c


async def _chunks(total: int) -> AsyncIterator[bytes]:
    yield b'{"tier": "warm", "padding": "'
    for _ in range(total // 100):
        yield b"x" * 100
    yield b'"}'


@pytest.mark.parametrize("path, protocol", [("/v1/admin/evict-idle", "anthropic"), ("/v1/messages", "anthropic"),
                                            ("/v1/chat/completions", "openai")])
async def test_oversized_body_is_413_by_length_and_when_chunked(
    small_body: httpx.AsyncClient, path: str, protocol: str
) -> None:
    by_length = await small_body.post(path, content=b" " * 2000, headers=JSON)
    chunked = await small_body.post(path, content=_chunks(2000), headers=JSON)
    assert "content-length" not in chunked.request.headers
    for response in (by_length, chunked):
        if protocol == "openai":
            assert "1048 byte limit" in assert_openai_error(response, 413, "invalid_request_error")["message"]
        else:
            assert "1048 byte limit" in assert_anthropic_error(response, 413, "request_too_large")["error"]["message"]


async def test_small_chunked_body_passes_the_limit(small_body: httpx.AsyncClient) -> None:
    response = await small_body.post("/v1/admin/evict-idle", content=_chunks(300), headers=JSON)
    assert response.json() == {"evicted": 0}


async def test_unknown_route_is_404_in_the_error_shape(client: httpx.AsyncClient) -> None:
    body = assert_anthropic_error(await client.get("/v1/nothing-here"), 404, "not_found_error")
    assert body["error"]["message"] == "no route for GET /v1/nothing-here"
    assert_openai_error(await client.post("/v1/chat/completions/extra", json={}), 404, "invalid_request_error")


@pytest.mark.parametrize("path, protocol", [("/v1/messages", "anthropic"), ("/v1/admin/evict-idle", "anthropic"),
                                            ("/v1/chat/completions", "openai")])
async def test_malformed_json_is_400_in_the_protocol_shape(client: httpx.AsyncClient, path: str, protocol: str) -> None:
    response = await client.post(path, content=b'{"model": "x", "messages": [', headers=JSON)
    if protocol == "openai":
        message = assert_openai_error(response, 400, "invalid_request_error")["message"]
    else:
        message = assert_anthropic_error(response, 400, "invalid_request_error")["error"]["message"]
    assert message.startswith("malformed JSON body")


# -- metrics ----------------------------------------------------------------------------------

METRIC_NAMES = (
    "semantic_requests_total", "semantic_tokens_generated_total", "semantic_prompt_tokens_total",
    "semantic_time_to_first_token_seconds_bucket", "semantic_request_duration_seconds_count", "semantic_ready",
    "semantic_pool_utilization_ratio", "semantic_pool_blocks", "semantic_pool_bytes", "semantic_agents",
    "semantic_agents_active", "semantic_request_queue_depth", "semantic_batch_size",
    "semantic_decode_tokens_per_second", "semantic_prefill_tokens_per_second", "semantic_warm_bytes",
    "semantic_cache_restores_total", "semantic_cache_hits_total", "semantic_cache_misses_total",
)


async def test_metrics_expose_the_documented_names_after_a_request(client: httpx.AsyncClient) -> None:
    await one_turn(client, "count me")
    response = await client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {line.split(" ")[0] for line in response.text.splitlines() if line and not line.startswith("#")}
    names = {sample.split("{")[0] for sample in samples}
    assert set(METRIC_NAMES) <= names, set(METRIC_NAMES) - names
    assert 'semantic_requests_total{outcome="stop",protocol="anthropic"}' in samples
    assert 'semantic_agents{tier="hot"}' in samples
    generated = next(line for line in response.text.splitlines() if line.startswith("semantic_tokens_generated_total"))
    assert float(generated.split(" ")[1]) == len("Hello from the scripted model.")
