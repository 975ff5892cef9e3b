"""Eight streaming clients on eight agents at once, on the real SmolLM2.

Four speak Anthropic SSE and four OpenAI SSE, read raw with httpx so every
frame is checked against its grammar (tests/model/sse_grammar.py). The
engine must decode them in one batch: a poller watches /v1/stats for a
batch larger than one while they run. Aggregate throughput is printed and
recorded as a test property, never asserted: this 2-core machine is shared.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from tests.model.real_api import RealApi, StatsPoller, running_api, wait_for
from tests.model.sse_grammar import check_anthropic_stream, check_openai_stream

# Over 32 tokens, so no request counts as a Claude Code side request.
MAX_TOKENS = 48
# Open-ended asks, so that most streams run to MAX_TOKENS and overlap for long.
TOPICS = ["a dragon", "the sea", "a robot", "a lighthouse", "a forest", "a train", "the moon", "a cat"]
STREAM_TIMEOUT = httpx.Timeout(300, connect=30)


@dataclass(frozen=True, slots=True)
class StreamResult:
    protocol: str
    session: str
    generated: int
    text: str


@pytest.fixture(scope="module")
def api(smollm2, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApi]:
    with running_api(smollm2, tmp_path_factory.mktemp("concurrent-cache"), smollm2_path) as running:
        yield running


def story(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about {topic}."}]


async def collect(client: httpx.AsyncClient, path: str, body: dict, headers: dict[str, str]) -> str:
    async with client.stream("POST", path, json=body, headers=headers) as response:
        raw = (await response.aread()).decode()
    assert response.status_code == 200, raw
    assert response.headers["content-type"].startswith("text/event-stream")
    return raw


async def anthropic_stream(client: httpx.AsyncClient, topic: str) -> StreamResult:
    session = str(uuid.uuid4())
    body = {"model": "claude-opus-4-1", "max_tokens": MAX_TOKENS, "stream": True, "messages": story(topic)}
    raw = await collect(client, "/v1/messages", body, {"X-Claude-Code-Session-Id": session})
    stream = check_anthropic_stream(raw)
    return StreamResult("anthropic", session, stream.final_usage["output_tokens"], stream.text)


async def openai_stream(client: httpx.AsyncClient, topic: str) -> StreamResult:
    session = f"concurrent-{uuid.uuid4().hex[:12]}"
    body = {"model": "gpt-4o", "max_tokens": MAX_TOKENS, "stream": True, "messages": story(topic),
            "stream_options": {"include_usage": True}, "session_id": session}
    stream = check_openai_stream(await collect(client, "/v1/chat/completions", body, {}))
    return StreamResult("openai", session, stream.usage["completion_tokens"], stream.text)


async def run_streams(url: str) -> tuple[list[StreamResult], float]:
    """All eight at once; returns the results and the wall time from first send to last frame."""
    kinds: list[Callable] = [anthropic_stream, openai_stream] * 4
    async with httpx.AsyncClient(base_url=url, timeout=STREAM_TIMEOUT) as client:
        began = time.monotonic()
        results = await asyncio.gather(*(kind(client, topic) for kind, topic in zip(kinds, TOPICS)))
        return list(results), time.monotonic() - began


def agents_by_session(api: RealApi, results: list[StreamResult]) -> list[dict] | None:
    """Each stream's agent from /v1/stats, once the snapshot shows every finished turn."""
    agents = api.stats()["agents"]
    mine = [[a for a in agents if r.session in a["agent_id"]] for r in results]
    if any(len(found) != 1 or found[0]["turns"] < 1 for found in mine):
        return None
    return [found[0] for found in mine]


async def test_eight_concurrent_streams_are_well_formed_and_batched(api: RealApi, record_property) -> None:
    with StatsPoller(api.url) as poller:
        results, wall_s = await run_streams(api.url)
    generated = sum(r.generated for r in results)
    rate = generated / wall_s
    print(f"\n8 concurrent streams: {generated} tokens in {wall_s:.2f} s = {rate:.1f} tok/s aggregate; "
          f"max batch seen {poller.max_batch} over {poller.samples} /v1/stats polls")
    record_property("aggregate_tok_s", round(rate, 1))
    record_property("max_batch_size", poller.max_batch)
    assert all(r.generated > 0 and r.text.strip() for r in results), results
    assert poller.max_batch > 1
    # The snapshot is republished a few times a second: wait for the one after the last finish.
    agents = await asyncio.to_thread(wait_for, lambda: agents_by_session(api, results), 30, "8 agents in /v1/stats")
    assert [a["turns"] for a in agents] == [1] * 8
    assert [a["source"] for a in agents] == ["claude-code", "openai"] * 4


async def test_a_turn_shows_in_the_live_stream_as_log_events_and_in_the_next_stats(api: RealApi) -> None:
    """GET /v1/stream on the real engine (this module's server): a turn's admit and finish arrive as log
    frames, and the stats frame after the finish lists its agent with the turn counted."""
    from tests.support.live_stream_client import frames, next_frame

    session = f"live-stream-{uuid.uuid4().hex[:8]}"
    body = {"model": "gpt-4o", "max_tokens": 8, "messages": story("a kite"), "session_id": session}
    async with httpx.AsyncClient(base_url=api.url, timeout=STREAM_TIMEOUT) as client:
        async with client.stream("GET", "/v1/stream", params={"interval": 0.2}) as response:
            assert response.status_code == 200
            stream = frames(response)
            hello = await next_frame(stream, "hello")
            turn = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            mine = []
            async with asyncio.timeout(120):
                while not any(f.data["kind"] == "finish" for f in mine):
                    frame = await next_frame(stream, "log")
                    if frame.data["agent_id"] and session in frame.data["agent_id"]:
                        mine.append(frame)
                agent = None
                while agent is None or agent["turns"] < 1:
                    stats = (await next_frame(stream, "stats")).data
                    agent = next((a for a in stats["agents"] if session in a["agent_id"]), None)
            assert (await turn).status_code == 200
    assert hello.data["model"] == api.engine.loaded.model_id
    kinds = [f.data["kind"] for f in mine]  # a "share" may come first: the prompt's head found in the prefix index
    assert "admit" in kinds and kinds[-1] == "finish" and kinds.index("admit") < len(kinds) - 1
    seqs = [f.data["seq"] for f in mine]
    assert seqs == sorted(seqs) and seqs[0] > hello.data["log_seq"]
    assert stats["models"] == [] and stats["pool"]["block_map"] is not None
