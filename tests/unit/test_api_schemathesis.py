"""Property-based tests of every documented operation, generated from the
app's own OpenAPI document by schemathesis, against a ScriptedEngine.

Each operation gets 25 generated requests (valid and invalid bodies, odd
path and query values); none may cause a 5xx, and every response must match
the content type and schema the app documents for its status. Streaming
responses are read to the end, so their SSE events are checked too.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from engine.api.app import create_app
from tests.support.router_app import make_service
from tests.support.scripted_engine import ScriptedEngine

# The scripted model answers at once whatever max_tokens a case asks for.
# The schema is read at import, so the app (and the directory its conversation
# store writes to) lives for the module; each run starts from an empty one.
CACHE_DIR = Path(tempfile.mkdtemp(prefix="semantic-schemathesis-"))
app = create_app(make_service(CACHE_DIR, ScriptedEngine()))
# GET /v1/stream never ends, so its response cannot be read to the end; its parameters, frames and errors are
# tested in test_live_stream.py.
schema = schemathesis.openapi.from_asgi("/openapi.json", app).exclude(path="/v1/stream")

CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


@pytest.fixture(scope="module", autouse=True)
def _remove_cache_dir() -> Iterator[None]:
    yield
    shutil.rmtree(CACHE_DIR, ignore_errors=True)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_operation_fails_or_breaks_its_documented_schema(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=CHECKS)


FUZZED = {
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
    ("GET", "/v1/responses/{response_id}/input_items"),
    ("GET", "/v1/agents"), ("POST", "/v1/agents"), ("GET", "/v1/agents/{agent_id}"), ("DELETE", "/v1/agents/{agent_id}"),
    ("POST", "/v1/agents/{agent_id}/messages"), ("POST", "/v1/agents/{agent_id}/evict"),
    ("POST", "/v1/agents/{agent_id}/pin"), ("POST", "/v1/admin/evict-idle"), ("POST", "/v1/admin/swap"),
    ("PUT", "/v1/admin/memory"),
}


def test_fuzzing_covers_the_protocol_and_agent_endpoints() -> None:
    """An endpoint left out of the OpenAPI document would silently drop out of the fuzzing above."""
    operations = {(result.ok().method.upper(), result.ok().path) for result in schema.get_all_operations()}
    assert FUZZED <= operations, FUZZED - operations
