"""Random JSON in request bodies of /v1/messages and /v1/chat/completions.

One field at a time (or the whole body, or the messages' roles and contents)
gets an arbitrary JSON value, text with lone surrogates and control
characters included. Whatever arrives, the server never answers 5xx, and
every 4xx is that protocol's error shape naming the field that was wrong.
Schemathesis (test_api_schemathesis.py) covers what the OpenAPI document
describes; this covers what it does not: values of the wrong kind anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings, strategies as st

from engine.api.app import create_app
from engine.api.errors import ANTHROPIC_TYPES
from tests.support.router_app import make_service
from tests.support.scripted_engine import ScriptedEngine

ANTHROPIC_BASE = {"model": "claude-opus-5-5", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
OPENAI_BASE = {"model": "gpt-4o", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC_FIELDS = ["model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                    "temperature", "top_p", "top_k", "stream", "metadata", "thinking"]
OPENAI_FIELDS = ["model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed",
                 "tools", "tool_choice", "stream", "stream_options", "session_id", "user", "n"]
WHOLE_BODY = "body"

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
roles = st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | st.text(max_size=6)
blocks = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"])
                                | st.text(max_size=5)}, optional={"text": json_values, "content": json_values,
                                                                  "id": json_values, "name": json_values,
                                                                  "input": json_values, "tool_use_id": json_values})
contents = st.text(max_size=20) | st.lists(blocks, max_size=3) | json_values
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": contents},
                                          optional={"tool_calls": json_values, "tool_call_id": json_values}),
                    min_size=1, max_size=3)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    cache_dir: Path = tmp_path_factory.mktemp("fuzz-cache")
    # raise_server_exceptions: an unhandled error fails the example with its traceback.
    with TestClient(create_app(make_service(cache_dir, ScriptedEngine()))) as client:
        yield client


def mutated(base: dict[str, Any], fields: list[str]) -> st.SearchStrategy[tuple[str, Any]]:
    one_field = st.sampled_from(fields).flatmap(
        lambda name: (messages | json_values if name == "messages" else json_values).map(
            lambda value: (name, {**base, name: value})))
    whole = json_values.map(lambda value: (WHOLE_BODY, value))
    return one_field | whole


def post(http: TestClient, path: str, body: Any) -> Any:
    # ensure_ascii: lone surrogates travel as \ud800 escapes, as a JSON encoder would send them.
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def names(field: str, text: str | None) -> bool:
    return text is not None and (text == field or text.startswith((f"{field}.", f"{field}:", f"{field} ")))


def mentions(field: str, message: str) -> bool:
    """A replaced body has no single bad field: naming whatever is wrong with it is enough."""
    return field == WHOLE_BODY or field in message


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(case=mutated(ANTHROPIC_BASE, ANTHROPIC_FIELDS))
def test_anthropic_messages_never_fail_and_name_the_bad_field(http: TestClient, case: tuple[str, Any]) -> None:
    field, body = case
    response = post(http, "/v1/messages", body)
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()
        assert set(error) == {"type", "error"} and error["type"] == "error", error
        assert error["error"]["type"] == ANTHROPIC_TYPES[response.status_code]
        assert mentions(field, error["error"]["message"]), (field, error)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(case=mutated(OPENAI_BASE, OPENAI_FIELDS))
def test_openai_chat_completions_never_fail_and_name_the_bad_field(http: TestClient, case: tuple[str, Any]) -> None:
    field, body = case
    response = post(http, "/v1/chat/completions", body)
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error" and error["message"]
        assert names(field, error["param"]) or (error["param"] is None and mentions(field, error["message"])) \
            or field == WHOLE_BODY, (field, error)
