"""Security properties of the HTTP layer: API keys compared in constant time,
no internals in error responses, and loopback unless remote access is asked for."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from engine.api import anthropic_stream, openai_stream
from engine.api.app import create_app
from engine.api.serve import HeadlessRun
from engine.domain.requests import GenerationRequest
from engine.settings import load_settings
from semantic_cli.main import main
from tests.support.router_app import make_service
from tests.support.scripted_engine import ScriptedEngine
from tests.unit.test_api_admin import assert_anthropic_error, assert_openai_error

KEY = "s3cret-key-0123456789"
SECRET = "/home/someone/.ssh/id_rsa and another agent's prompt"
ANTHROPIC_BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
OPENAI_BODY = {"messages": [{"role": "user", "content": "hi"}]}


def asgi_client(app: Any) -> httpx.AsyncClient:
    # raise_app_exceptions=False: look at the 500 a client gets, as uvicorn would send it.
    return httpx.AsyncClient(transport=httpx.ASGITransport(app, raise_app_exceptions=False), base_url="http://t")


# -- API key --------------------------------------------------------------------------------------


@pytest.fixture
async def keyed(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(create_app(make_service(tmp_path, ScriptedEngine(), api_key=KEY))) as client:
        yield client


async def test_api_keys_are_compared_with_hmac_compare_digest(
    keyed: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``==`` stops at the first differing byte; its timing would leak the key a byte at a time."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    assert (await keyed.get("/v1/stats", headers={"x-api-key": KEY})).status_code == 200
    assert (await keyed.get("/v1/stats", headers={"authorization": f"Bearer {KEY[:-1]}X"})).status_code == 401
    assert calls == [(KEY.encode(), KEY.encode()), (f"{KEY[:-1]}X".encode(), KEY.encode())]


@pytest.mark.parametrize("headers", [
    {}, {"x-api-key": ""}, {"x-api-key": KEY[:-1]}, {"x-api-key": KEY + "x"}, {"x-api-key": KEY.upper()},
    {"authorization": KEY}, {"authorization": f"Basic {KEY}"}, {"authorization": "Bearer "},
], ids=["none", "empty", "prefix", "longer", "case", "no-scheme", "basic", "empty-bearer"])
async def test_a_wrong_or_missing_key_is_401_in_each_protocols_shape(
    keyed: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    assert_anthropic_error(await keyed.post("/v1/messages", json=ANTHROPIC_BODY, headers=headers),
                           401, "authentication_error")
    assert_anthropic_error(await keyed.post("/v1/agents", json={}, headers=headers), 401, "authentication_error")
    assert_openai_error(await keyed.post("/v1/chat/completions", json=OPENAI_BODY, headers=headers),
                        401, "authentication_error")


async def test_a_key_with_bytes_outside_ascii_is_refused_not_an_error(keyed: httpx.AsyncClient) -> None:
    response = await keyed.get("/v1/stats", headers=[(b"x-api-key", "s3cret-\u00e9".encode())])
    assert_anthropic_error(response, 401, "authentication_error")


# -- no internals in responses --------------------------------------------------------------------


class BrokenEngine(ScriptedEngine):
    """A bug inside the engine's client interface, raised in the route itself."""

    def validate(self, request: GenerationRequest) -> GenerationRequest:
        raise KeyError(SECRET)

    def fresh_snapshot(self) -> Any:
        raise RuntimeError(SECRET)

    def snapshot(self) -> Any:
        raise RuntimeError(SECRET)


def assert_generic_500(response: httpx.Response, caplog: pytest.LogCaptureFixture) -> str:
    """The request id of a 500 that says nothing about its cause, whose traceback is in the log."""
    assert response.status_code == 500
    request_id = response.headers["request-id"]
    assert request_id.startswith("req_")
    for leaked in (SECRET, "Traceback", "KeyError", "RuntimeError", ".py"):
        assert leaked not in response.text
    (record,) = [r for r in caplog.records if request_id in r.getMessage()]
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert SECRET in str(record.exc_info[1])
    return request_id


@pytest.mark.parametrize("method, path, body, protocol", [
    ("POST", "/v1/messages", ANTHROPIC_BODY, "anthropic"),
    ("POST", "/v1/messages", {**ANTHROPIC_BODY, "stream": True}, "anthropic"),
    ("POST", "/v1/chat/completions", OPENAI_BODY, "openai"),
    ("POST", "/v1/chat/completions", {**OPENAI_BODY, "stream": True}, "openai"),
    ("GET", "/v1/agents", None, "anthropic"),
])
async def test_an_unexpected_exception_is_a_generic_500_with_a_request_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, method: str, path: str, body: Any, protocol: str,
) -> None:
    async with asgi_client(create_app(make_service(tmp_path, BrokenEngine()))) as client:
        response = await client.request(method, path, json=body)
    request_id = assert_generic_500(response, caplog)
    if protocol == "openai":
        error = assert_openai_error(response, 500, "server_error")
    else:
        error = assert_anthropic_error(response, 500, "api_error")["error"]
    assert error["message"] == f"internal server error (request id {request_id})"


async def test_an_exception_after_the_200_ends_the_stream_with_a_generic_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(anthropic_stream.ContentBlocks, "add", broken)
    monkeypatch.setattr(openai_stream.ChatStream, "_pieces", broken)
    async with asgi_client(create_app(make_service(tmp_path, ScriptedEngine()))) as client:
        anthropic = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "stream": True})
        openai = await client.post("/v1/chat/completions", json={**OPENAI_BODY, "stream": True})
    for response in (anthropic, openai):
        assert response.status_code == 200
        for leaked in (SECRET, "Traceback", "RuntimeError"):
            assert leaked not in response.text
    last = anthropic.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ") and '"type":"api_error"' in last.replace(" ", "")
    assert "internal server error (request id req_" in last
    frames = openai.text.strip().split("\n\n")
    assert frames[-1] == "data: [DONE]" and '"type":"server_error"' in frames[-2]
    assert "internal server error (request id req_" in frames[-2]
    assert len([r for r in caplog.records if r.exc_info and SECRET in str(r.exc_info[1])]) == 2


# -- where the server listens ---------------------------------------------------------------------


def test_the_server_binds_loopback_by_default(tmp_path: Path) -> None:
    run = HeadlessRun(load_settings(cache_dir=tmp_path, port=0), lambda settings, progress: ScriptedEngine())
    assert run.server.host == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_a_non_loopback_host_without_allow_remote_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], host: str
) -> None:
    assert main(["--serve", "--cache-dir", str(tmp_path), "--host", host]) == 2
    err = capsys.readouterr().err
    assert "--allow-remote" in err and "Traceback" not in err
    assert load_settings(host=host, allow_remote=True).host == host
