"""Anthropic cache diagnostics (beta cache-diagnosis-2026-04-07) against a ScriptedEngine, and with the
official SDK: each change between two turns gets the documented reason and the exact missed tokens."""

from __future__ import annotations

from typing import Any, Iterator

import anthropic
import httpx
import pytest

from engine.api.cache_diagnostics import BETA, Fingerprint, FingerprintStore
from tests.support.router_app import LiveServer, build_app, make_service
from tests.support.scripted_engine import ScriptedEngine
from tests.unit.anthropic_helpers import sse_events

URL = "/v1/messages"
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": f"claude-code-20250219,{BETA}",
           "x-claude-code-session-id": "diag-session"}
SYSTEM = [{"type": "text", "text": "You are terse. Today's date is 2026-11-28.", "cache_control": {"type": "ephemeral"}}]
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"name": "get_time", "description": "Time in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(lambda request: "Sure.")


def turn(messages: list[dict[str, Any]], previous: str | None, **fields: Any) -> dict[str, Any]:
    return {"model": "claude-opus-5-5", "max_tokens": 64, "system": SYSTEM, "tools": TOOLS, "messages": messages,
            "diagnostics": {"previous_message_id": previous}, **fields}


FIRST = [{"role": "user", "content": "Weather in Paris?"}]
NEXT = FIRST + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And Rome?"}]


async def two_turns(client: httpx.AsyncClient, change: dict[str, Any], stream: bool = False) -> tuple[dict, dict]:
    first = (await client.post(URL, json=turn(FIRST, None), headers=HEADERS)).json()
    second_body = {**turn(NEXT, first["id"]), **change, "stream": stream}
    response = await client.post(URL, json=second_body, headers=HEADERS)
    assert response.status_code == 200, response.text
    if stream:
        events = sse_events(response.text)
        return first, events[0][1]["message"]
    return first, response.json()


def prompt_of(engine: ScriptedEngine, index: int) -> tuple[int, ...]:
    return engine.requests[index].prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_nothing_changed_is_a_null_diagnosis(client: httpx.AsyncClient, stream: bool) -> None:
    first, second = await two_turns(client, {}, stream)
    assert "diagnostics" in first and first["diagnostics"] is None  # opted in on the first turn
    assert "diagnostics" in second and second["diagnostics"] is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("change, reason", [
    ({"model": "claude-sonnet-5"}, "model_changed"),
    ({"speed": "fast"}, "model_changed"),
    ({"system": [{"type": "text", "text": "You are terse. Today's date is 2026-11-29."}]}, "system_changed"),
    ({"tools": [TOOLS[0], {**TOOLS[1], "description": "Local time in a city"}]}, "tools_changed"),
    ({"tools": TOOLS[::-1]}, "tools_changed"),
    ({"messages": [{"role": "user", "content": "Weather in Lyon?"}, *NEXT[1:]]}, "messages_changed"),
])
async def test_each_change_names_its_reason_and_the_missed_tokens(
        client: httpx.AsyncClient, engine: ScriptedEngine, change: dict, reason: str, stream: bool) -> None:
    _, second = await two_turns(client, change, stream)
    miss = second["diagnostics"]["cache_miss_reason"]
    assert miss["type"] == reason
    before, now = prompt_of(engine, 0), prompt_of(engine, 1)
    common = next((i for i, (a, b) in enumerate(zip(before, now)) if a != b), min(len(before), len(now)))
    if reason == "model_changed":  # another model's cache: all of it (the prompt renders the same here)
        assert miss["cache_missed_input_tokens"] == len(before)
    else:
        assert miss["cache_missed_input_tokens"] == len(before) - common > 0


async def test_a_moved_cache_breakpoint_is_no_change(client: httpx.AsyncClient) -> None:
    moved = [{"type": "text", "text": SYSTEM[0]["text"]}]
    _, second = await two_turns(client, {"system": moved, "cache_control": {"type": "ephemeral"}})
    assert second["diagnostics"] is None


async def test_another_tool_choice_is_unavailable(client: httpx.AsyncClient) -> None:
    _, second = await two_turns(client, {"tool_choice": {"type": "any"}})
    assert second["diagnostics"] == {"cache_miss_reason": {"type": "unavailable"}}


async def test_an_unknown_previous_id_is_not_found(client: httpx.AsyncClient) -> None:
    response = await client.post(URL, json=turn(FIRST, "msg_0123456789abcdef01234567"), headers=HEADERS)
    assert response.json()["diagnostics"] == {"cache_miss_reason": {"type": "previous_message_not_found"}}


async def test_without_the_beta_or_the_field_there_is_no_diagnostics_key(client: httpx.AsyncClient) -> None:
    first = (await client.post(URL, json=turn(FIRST, None), headers=HEADERS)).json()
    no_beta = {k: v for k, v in HEADERS.items() if k != "anthropic-beta"}
    without_beta = (await client.post(URL, json=turn(NEXT, first["id"]), headers=no_beta)).json()
    body = turn(NEXT, None)
    del body["diagnostics"]
    without_field = (await client.post(URL, json=body, headers=HEADERS)).json()
    assert "diagnostics" not in without_beta and "diagnostics" not in without_field


def test_fingerprints_are_kept_per_agent_as_long_as_its_cache_history() -> None:
    store = FingerprintStore(per_agent=2, limit=3)
    make = lambda agent: Fingerprint.of(agent, {"model": "m", "messages": []}, (1, 2))  # noqa: E731
    for n in range(3):
        store.put(f"msg_a{n}", make("a"))
    assert store.get("msg_a0") is None and store.get("msg_a2") is not None and len(store) == 2
    store.put("msg_b0", make("b"))
    store.put("msg_b1", make("b"))  # over the overall limit: the oldest of all goes
    assert store.get("msg_a1") is None and len(store) == 3


# -- the official SDK -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine = ScriptedEngine(lambda request: "Sure.")
    with LiveServer(build_app(make_service(tmp_path_factory.mktemp("diag"), engine))) as server:
        yield server


def test_the_sdk_sends_diagnostics_and_reads_the_reason(live: LiveServer) -> None:
    client = anthropic.Anthropic(api_key="x", base_url=live.url, max_retries=0)
    first = client.beta.messages.create(model="claude-opus-5-5", max_tokens=64, system="Today is Monday.",
                                        messages=FIRST, diagnostics={"previous_message_id": None}, betas=[BETA])
    assert first.diagnostics is None
    second = client.beta.messages.create(model="claude-opus-5-5", max_tokens=64, system="Today is Tuesday.",
                                         messages=NEXT, diagnostics={"previous_message_id": first.id}, betas=[BETA])
    assert second.diagnostics is not None and second.diagnostics.cache_miss_reason is not None
    assert second.diagnostics.cache_miss_reason.type == "system_changed"
    assert second.diagnostics.cache_miss_reason.cache_missed_input_tokens > 0
    with client.beta.messages.stream(model="claude-opus-5-5", max_tokens=64, system="Today is Tuesday.",
                                     messages=NEXT, diagnostics={"previous_message_id": second.id},
                                     betas=[BETA]) as stream:
        final = stream.get_final_message()
    assert final.diagnostics is None  # the same request again: nothing diverged
