"""Hostile request bodies and identifiers against a ScriptedEngine: deep
nesting, bytes that are not UTF-8, strings that are not Unicode, control
characters, and agent ids made to break headers or reach the file system.

Every rejection is a 400 in the protocol's own error shape that names the bad
field, and none of them reaches the engine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from engine.api.app import create_app
from engine.api.json_guard import MAX_JSON_DEPTH, json_depth, lone_surrogate_path
from tests.support.router_app import make_service
from tests.support.scripted_engine import ScriptedEngine
from tests.unit.test_api_admin import assert_anthropic_error, assert_openai_error

JSON = {"content-type": "application/json"}
ANTHROPIC = "/v1/messages"
OPENAI = "/v1/chat/completions"
# (path, protocol, a valid body whose "messages" can be replaced)
ENDPOINTS = [
    (ANTHROPIC, "anthropic", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    (OPENAI, "openai", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/agents", "anthropic", {"agent_id": "planner", "system": "hi"}),
]


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


def assert_400(response: httpx.Response, protocol: str) -> str:
    """The message of a 400 in the protocol's shape."""
    if protocol == "openai":
        return assert_openai_error(response, 400, "invalid_request_error")["message"]
    return assert_anthropic_error(response, 400, "invalid_request_error")["error"]["message"]


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def with_field(base: dict[str, Any], name: str, raw: bytes) -> bytes:
    """``base`` as JSON with ``name`` set to the raw JSON text ``raw``."""
    marker = "\x00SLOT\x00"
    text = json.dumps({**base, name: marker}).encode()
    return text.replace(json.dumps(marker).encode(), raw)


# -- nesting ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, protocol, base", ENDPOINTS)
async def test_100k_nested_lists_are_a_quick_400_not_a_recursion_error(
    client: httpx.AsyncClient, engine: ScriptedEngine, path: str, protocol: str, base: dict[str, Any]
) -> None:
    for body in (nested(100_000), with_field(base, "messages", nested(100_000))):
        began = time.monotonic()
        response = await client.post(path, content=body, headers=JSON)
        assert time.monotonic() - began < 2
        assert f"deeper than {MAX_JSON_DEPTH} levels" in assert_400(response, protocol)
    assert engine.requests == []


@pytest.mark.parametrize("path, protocol, base", ENDPOINTS[:2])
async def test_nesting_up_to_the_limit_is_served(
    client: httpx.AsyncClient, path: str, protocol: str, base: dict[str, Any]
) -> None:
    # Tool schemas are where real clients nest: body, tools list, tool (and function) and schema objects.
    if protocol == "anthropic":
        tool = b'{"name": "t", "input_schema": {"type": "object", "x": ' + nested(MAX_JSON_DEPTH - 4) + b"}}"
    else:
        tool = b'{"type": "function", "function": {"name": "t", "parameters": {"x": ' + nested(MAX_JSON_DEPTH - 5) + b"}}}"
    at_limit = with_field(base, "tools", b"[" + tool + b"]")
    assert json_depth(at_limit) == MAX_JSON_DEPTH
    assert (await client.post(path, content=at_limit, headers=JSON)).status_code == 200
    over = at_limit.replace(b"[]", b"[[]]", 1)
    refused = await client.post(path, content=over, headers=JSON)
    assert f"deeper than {MAX_JSON_DEPTH} levels" in assert_400(refused, protocol)


def test_depth_ignores_brackets_inside_strings() -> None:
    assert json_depth(b'{"a": "[[[[{{{{\\"[[[", "b": [1, "]]]]"]}') == 2
    assert json_depth(b'"\\\\"') == 0
    assert json_depth(b"[]") == 1 and json_depth(b"[[], [[]]]") == 3


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab[]{}"\\ \n\u00e9')),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=30,
)


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans())
def test_depth_of_any_json_document_is_exact(value: Any, ascii_only: bool) -> None:
    assert json_depth(json.dumps(value, ensure_ascii=ascii_only).encode()) == depth_of(value)


# -- encoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path, protocol, base", ENDPOINTS)
async def test_a_body_that_is_not_utf8_is_400(
    client: httpx.AsyncClient, engine: ScriptedEngine, path: str, protocol: str, base: dict[str, Any]
) -> None:
    for body in (with_field(base, "system", b'"caf\xe9"'), json.dumps(base).encode("utf-16")):
        message = assert_400(await client.post(path, content=body, headers=JSON), protocol)
        assert "not valid UTF-8" in message
    assert engine.requests == []


@pytest.mark.parametrize("path, protocol, base", ENDPOINTS[:2])
async def test_a_lone_surrogate_is_400_naming_the_field(
    client: httpx.AsyncClient, engine: ScriptedEngine, path: str, protocol: str, base: dict[str, Any]
) -> None:
    body = with_field(base, "messages", b'[{"role": "user", "content": "ok \\ud83d\\ude00 then \\udc00"}]')
    response = await client.post(path, content=body, headers=JSON)
    assert assert_400(response, protocol).startswith("messages.0.content: ")
    if protocol == "openai":
        assert response.json()["error"]["param"] == "messages.0.content"
    key = with_field(base, "metadata", b'{"\\ud800": 1}')
    assert assert_400(await client.post(path, content=key, headers=JSON), protocol).startswith("metadata.\ud800")
    assert engine.requests == []


def test_surrogate_pairs_are_text_and_lone_halves_are_found_by_path() -> None:
    assert lone_surrogate_path(json.loads('{"a": ["\\ud83d\\ude00"]}')) is None
    assert lone_surrogate_path(json.loads('{"a": [1, {"b": "x\\ud83d"}]}')) == "a.1.b"
    assert lone_surrogate_path("\udfff") == ""


@pytest.mark.parametrize("path, protocol, base", ENDPOINTS[:2])
async def test_raw_control_characters_are_malformed_json_but_escaped_ones_are_text(
    client: httpx.AsyncClient, engine: ScriptedEngine, path: str, protocol: str, base: dict[str, Any]
) -> None:
    raw = with_field(base, "messages", b'[{"role": "user", "content": "a\x01b"}]')
    response = await client.post(path, content=raw, headers=JSON)
    assert assert_400(response, protocol).startswith("malformed JSON body")
    if protocol == "openai":
        assert response.json()["error"]["param"] is None  # a character offset is not a field
    # Terminal output that Claude Code forwards: colours, carriage returns, even NUL.
    terminal = "\x1b[31mred\x1b[0m\r\nok\x00"
    escaped = {**base, "messages": [{"role": "user", "content": terminal}]}
    assert (await client.post(path, json=escaped)).status_code == 200
    prompt = bytes(t for t in engine.requests[-1].prompt_tokens if t < 256)
    assert terminal.encode() in prompt


# -- identifiers --------------------------------------------------------------------------------

HOSTILE_IDS = [
    b"a\r\nX-Injected: 1", b"a\nb", b"a\x00b", b"../../etc/passwd", b"a/b", b"..", b"a\\b",
    b"x" * 200, "caf\u00e9".encode(), "\u202eevil".encode(), b"a b", b"-rf",
]
# (protocol, where the id goes, the field an error must name)
CARRIERS = [
    ("openai", "X-Session-Id", "X-Session-Id"),
    ("openai", "session_id", "session_id"),
    ("anthropic", "x-claude-code-session-id", "X-Claude-Code-Session-Id"),
    ("anthropic", "x-claude-code-agent-id", "x-claude-code-agent-id"),
]


def _request_for(protocol: str, carrier: str, value: bytes) -> tuple[str, dict[str, Any], list[tuple[bytes, bytes]]]:
    headers: list[tuple[bytes, bytes]] = []
    if protocol == "openai":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
        if carrier == "session_id":
            body["session_id"] = value.decode()
        else:
            headers.append((carrier.encode(), value))
        return OPENAI, body, headers
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    if carrier == "x-claude-code-agent-id":
        headers.append((b"x-claude-code-session-id", b"5f0c9a4e-0000-4000-8000-000000000001"))
    headers.append((carrier.encode(), value))
    return ANTHROPIC, body, headers


def _raw_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return list(response.headers.raw)


@pytest.mark.parametrize("protocol, carrier, field", CARRIERS)
@pytest.mark.parametrize("value", HOSTILE_IDS, ids=lambda v: repr(v)[:24])
async def test_hostile_session_ids_are_400_and_never_reflected(
    client: httpx.AsyncClient, engine: ScriptedEngine, tmp_path: Path,
    protocol: str, carrier: str, field: str, value: bytes,
) -> None:
    path, body, headers = _request_for(protocol, carrier, value)
    # Raw bytes: a real HTTP stack refuses CR/LF in headers, but a proxy or an ASGI host may not.
    response = await client.post(path, content=json.dumps(body).encode(),
                                 headers=[(b"content-type", b"application/json"), *headers])

    message = assert_400(response, protocol)
    assert message.startswith(field)
    if protocol == "openai":
        assert response.json()["error"]["param"] == field
    for name, header_value in _raw_headers(response):
        assert name != b"x-injected" and not set(header_value) & set(b"\r\n\x00")
        assert value not in header_value
    assert value.decode("latin-1") not in response.text
    assert engine.requests == []
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


async def test_an_accepted_session_id_is_the_only_thing_reflected(client: httpx.AsyncClient) -> None:
    response = await client.post(OPENAI, json={"messages": [{"role": "user", "content": "hi"}]},
                                 headers={"X-Session-Id": "chat_1-A"})
    assert response.status_code == 200
    assert response.headers["x-semantic-agent-id"] == "oa-chat_1-A"


HOSTILE_PATHS = ["%2E%2E", "a%00b", "a%0D%0AX-Injected:%201", "%C3%A9t%C3%A9", "x" * 129, "-rf",
                 "a%20b", "%E2%80%AEevil"]


@pytest.mark.parametrize("raw", HOSTILE_PATHS, ids=lambda v: v[:20])
async def test_hostile_agent_ids_in_the_direct_api_are_400_and_touch_no_file(
    client: httpx.AsyncClient, engine: ScriptedEngine, tmp_path: Path, raw: str,
) -> None:
    before = sorted(tmp_path.rglob("*"))
    for method, suffix, body in (("GET", "", None), ("DELETE", "", None), ("POST", "/messages", {"content": "hi"}),
                                 ("POST", "/evict", {"tier": "warm"}), ("POST", "/pin", {"pinned": True})):
        response = await client.request(method, f"/v1/agents/{raw}{suffix}", json=body)
        assert assert_400(response, "anthropic").startswith("agent_id must be"), (method, suffix)
        assert all(name != b"x-injected" for name, _ in _raw_headers(response))
    created = await client.post("/v1/agents", json={"agent_id": httpx.URL(f"/{raw}").path[1:]})
    assert assert_400(created, "anthropic").startswith("agent_id must be")
    assert sorted(tmp_path.rglob("*")) == before
    assert engine.requests == []


async def test_ids_with_path_separators_never_become_paths(client: httpx.AsyncClient, tmp_path: Path) -> None:
    before = sorted(tmp_path.rglob("*"))
    for raw in ("..%2F..%2Fetc", "a%2Fb", "..%5C..%5Cx"):
        response = await client.post(f"/v1/agents/{raw}/messages", json={"content": "hi"})
        # A decoded "/" no longer matches the route at all; a backslash is refused by name.
        assert response.status_code in (400, 404)
        assert_anthropic_error(response, response.status_code,
                               "invalid_request_error" if response.status_code == 400 else "not_found_error")
    for agent_id in ("../../etc/passwd", "a/b", "..\\x", "/abs"):
        refused = await client.post("/v1/agents", json={"agent_id": agent_id})
        assert assert_400(refused, "anthropic").startswith("agent_id must be")
    assert sorted(tmp_path.rglob("*")) == before


# -- size ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, protocol", [(ANTHROPIC, "anthropic"), (OPENAI, "openai"),
                                            ("/v1/agents", "anthropic"), ("/v1/agents/a1/messages", "anthropic")])
async def test_oversized_bodies_are_413_before_any_parsing(tmp_path: Path, path: str, protocol: str) -> None:
    engine = ScriptedEngine()
    app = create_app(make_service(tmp_path, engine, max_body_mb=0.01))  # 10485 bytes

    async def deep_chunks() -> Any:
        for _ in range(100):
            yield b"[" * 1000

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        for body in (nested(50_000), deep_chunks()):
            response = await http.post(path, content=body, headers=JSON)
            if protocol == "openai":
                message = assert_openai_error(response, 413, "invalid_request_error")["message"]
            else:
                message = assert_anthropic_error(response, 413, "request_too_large")["error"]["message"]
            assert "10485 byte limit" in message
    assert engine.requests == []
