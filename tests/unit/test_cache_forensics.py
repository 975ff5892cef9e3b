"""Why a turn missed the cache: every turn records how its prompt met the agent's cache (issue 14)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine.api.app import create_app
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.domain.forensics import CacheOutcome, examine
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from tests.support.byte_tokenizer import BOS
from tests.support.router_app import LiveServer, make_service
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_engine_batching import make_engine

pytestmark = pytest.mark.unit

SYSTEM = "You are a coding agent. Be brief.\nToday's date is {date}.\nUse the tools when needed."


def byte_prompt(text: str) -> tuple[int, ...]:
    return (BOS, *text.encode())


def test_a_date_line_that_changed_is_found_in_the_system_prompt_and_named() -> None:
    engine = make_engine("llama", block_tokens=16)
    try:
        first = SYSTEM.format(date="2026-11-25") + "\nuser: list the files"
        run_turn(engine, GenerationRequest("a", byte_prompt(first), 4, head_tokens=len(byte_prompt(SYSTEM)) - 4))
        second = SYSTEM.format(date="2026-11-26") + "\nuser: list the files"
        result = run_turn(engine, GenerationRequest("a", byte_prompt(second), 4,
                                                    head_tokens=len(byte_prompt(SYSTEM)) - 4))
        usage = result.finish.usage
        expected_at = 1 + first.index("2026-11-25") + len("2026-11-2")  # the only differing byte: 5 vs 6
        assert usage.cache_outcome == CacheOutcome.DIVERGED.value
        assert usage.diverged_at == expected_at
        turn = engine.fresh_snapshot().agent("a").history[-1]
        divergence = turn.divergence
        assert divergence is not None and divergence.token == expected_at
        assert divergence.block == expected_at // 16
        assert divergence.region == "system prompt and tools"
        assert "2026-11-25" in divergence.cached_text and "2026-11-26" in divergence.prompt_text
        assert divergence.cached_text[:divergence.common_chars] == divergence.prompt_text[:divergence.common_chars]
        assert divergence.volatile is not None and "currentDate" in divergence.volatile
        assert turn.reused_tokens == usage.reused_tokens <= expected_at
    finally:
        engine.stop()


def test_outcomes_of_ordinary_turns() -> None:
    engine = make_engine("llama", block_tokens=16)
    try:
        prompt = byte_prompt("A long enough system prompt for a block or two.\nuser: hi")
        first = run_turn(engine, GenerationRequest("b", prompt, 4))
        assert first.finish.usage.cache_outcome == "new_agent"
        follow = prompt + tuple(first.tokens) + tuple(b"\nuser: more")
        assert run_turn(engine, GenerationRequest("b", follow, 4)).finish.usage.cache_outcome == "full"
        other = run_turn(engine, GenerationRequest("c", prompt[:-2] + tuple(b"yo"), 4))
        assert other.finish.usage.cache_outcome == "shared"
        engine.call(lambda e: e.ops.evict_agent("b", "cold")).result()
        again = run_turn(engine, GenerationRequest("b", follow, 4))
        assert again.finish.usage.cache_outcome in ("dropped", "shared")
        history = engine.fresh_snapshot().agent("b").history
        assert [t.outcome.value for t in history][:2] == ["new_agent", "full"]
        assert history[2].outcome.value == "dropped"
    finally:
        engine.stop()


def test_volatile_spans_and_regions_from_examine_alone() -> None:
    cached = list(b"System: Primary working directory: /tmp/aaa\nmessages follow")
    prompt = list(b"System: Primary working directory: /tmp/bbb\nmessages follow")
    record = examine(request_id="r", prompt=prompt, cached=cached, cached_tokens=len(cached), tier_before="hot",
                     model_changed=False, reused=40, source="self", note=None, side=False, head_tokens=10,
                     block_tokens=16, decode=lambda ids: bytes(ids).decode())
    assert record.outcome is CacheOutcome.DIVERGED
    assert record.divergence is not None and record.divergence.region == "messages"
    assert record.divergence.volatile == "the working directory line"
    moved = examine(request_id="r", prompt=prompt, cached=[], cached_tokens=0, tier_before="empty",
                    model_changed=True, reused=0, source="none", note=None, side=False, head_tokens=0,
                    block_tokens=16, decode=lambda ids: bytes(ids).decode())
    assert moved.outcome is CacheOutcome.MODEL_CHANGED and moved.divergence is None


async def test_agent_endpoint_and_metrics_show_the_divergence(tmp_path: Path) -> None:
    """Through the OpenAI API as a client sends it: the date in the system message changes between turns."""
    loaded = loaded_tiny("llama", block_tokens=16)
    engine = Engine(loaded, engine_settings(256 * loaded.spec.block_bytes, 4, 32))
    engine.start()
    try:
        with LiveServer(create_app(make_service(tmp_path, engine))) as server:  # type: ignore[arg-type]
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                for date in ("2026-11-25", "2026-11-26"):
                    body = {"model": "m", "session_id": "dated", "max_tokens": 3, "temperature": 0,
                            "messages": [{"role": "system", "content": SYSTEM.format(date=date)},
                                         {"role": "user", "content": "list the files"}]}
                    response = await client.post("/v1/chat/completions", json=body)
                    assert response.status_code == 200, response.text
                semantic = response.json()["usage"]["semantic"]
                assert semantic["cache_outcome"] == "diverged" and semantic["diverged_at"] > 0
                agent = (await client.get("/v1/agents/oa-dated")).json()
                last = agent["cache_history"][-1]
                assert last["outcome"] == "diverged"
                assert last["divergence"]["token"] == semantic["diverged_at"]
                assert last["divergence"]["region"] == "system prompt and tools"
                assert "2026-11-25" in last["divergence"]["cached_text"]
                assert "2026-11-26" in last["divergence"]["prompt_text"]
                metrics = (await client.get("/metrics")).text
                assert 'semantic_turn_cache_outcomes_total{outcome="diverged"} 1.0' in metrics
                assert 'semantic_turn_cache_outcomes_total{outcome="new_agent"} 1.0' in metrics
    finally:
        engine.stop(0.0)


async def test_a_claude_code_session_whose_system_prompt_changed_says_against_whom(tmp_path: Path) -> None:
    """Claude Code's main agent id carries a hash of the system prompt: a changed date line makes a new
    agent that shares the old one's prefix, and its forensics compare with that agent's tokens."""
    loaded = loaded_tiny("llama", block_tokens=16)
    engine = Engine(loaded, engine_settings(256 * loaded.spec.block_bytes, 4, 32))
    engine.start()
    headers = {"x-claude-code-session-id": "5f0c9a4e-0000-4000-8000-0000000000f1"}
    try:
        with LiveServer(create_app(make_service(tmp_path, engine))) as server:  # type: ignore[arg-type]
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                agents: list[str] = []
                for date in ("2026-11-25", "2026-11-26"):
                    body = {"model": "claude-opus-5-5", "max_tokens": 40, "temperature": 0,
                            "system": SYSTEM.format(date=date),
                            "messages": [{"role": "user", "content": "list the files"}]}
                    response = await client.post("/v1/messages", json=body, headers=headers)
                    assert response.status_code == 200, response.text
                    listing = (await client.get("/v1/agents")).json()["data"]
                    agents += [a["agent_id"] for a in listing if a["source"] == "claude-code"
                               and a["agent_id"] not in agents]
                assert len(agents) == 2
                last = (await client.get(f"/v1/agents/{agents[1]}")).json()["cache_history"][-1]
                assert last["outcome"] == "shared" and last["source"] == f"shared:{agents[0]}"
                divergence = last["divergence"]
                assert divergence["against"] == agents[0]
                assert divergence["region"] == "system prompt and tools"
                assert "2026-11-25" in divergence["cached_text"] and "2026-11-26" in divergence["prompt_text"]
                assert "currentDate" in divergence["volatile"]
    finally:
        engine.stop(0.0)


def test_an_image_that_differed_is_named_by_its_digest() -> None:
    from engine.domain.images import PromptImage, image_tokens

    head = list(b"User: look ")
    old = PromptImage(len(head), 4, "a" * 64 + ":p", "a" * 64, 1234, {})
    new = PromptImage(len(head), 4, "b" * 64 + ":p", "b" * 64, 5678, {})
    tail = list(b" what is it?")
    cached = head + image_tokens(old.key, 4) + tail
    prompt = head + image_tokens(new.key, 4) + tail
    record = examine(request_id="r", prompt=prompt, cached=cached, cached_tokens=len(cached), tier_before="hot",
                     model_changed=False, reused=len(head), source="self", note=None, side=False, head_tokens=0,
                     block_tokens=16, decode=lambda ids: bytes(ids).decode(), images=(new,))
    divergence = record.divergence
    assert divergence is not None and divergence.token == len(head)
    assert divergence.volatile == "image bbbbbbbbbbbb (5,678 bytes): not the image the cache holds here"
    # No tokenizer knows an image's tokens: the texts show each image as one marker.
    assert divergence.prompt_text == "User: look [image] what is it?"
