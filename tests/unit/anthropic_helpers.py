"""Shared by the Anthropic API tests: request bodies, an SSE parser, and a
checker of the stream grammar Claude Code relies on."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pydantic_core

from engine.domain.requests import FinishEvent, FinishReason, GenerationRequest, QueuedEvent, Usage
from tests.support.scripted_engine import ScriptedEngine

WEATHER_TOOL = {"name": "get_weather", "description": "Weather for a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_OUTPUT = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def body(content: Any = "Hello", **fields: Any) -> dict[str, Any]:
    return {"model": "claude-opus-5-5", "max_tokens": 200, "messages": [{"role": "user", "content": content}], **fields}


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) per frame; asserts the name matches the payload's type."""
    events = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"], frame
        events.append((lines["event"], data))
    return events


def names(events: list[tuple[str, dict[str, Any]]], pings: bool = False) -> list[str]:
    return [name for name, _ in events if pings or name != "ping"]


def assert_well_formed(events: list[tuple[str, dict[str, Any]]]) -> None:
    """message_start first, blocks opened in index order and never touched after their stop, then the end."""
    kinds = names(events)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    open_index, next_index = None, 0
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
        elif name in ("content_block_delta", "content_block_stop"):
            assert data["index"] == open_index, (name, data)
            open_index = None if name == "content_block_stop" else open_index
        elif name in ("message_delta", "message_stop"):
            assert open_index is None


def streamed_content(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content list a client rebuilds from the deltas."""
    blocks: list[dict[str, Any]] = []
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"], _json=""))
        elif name == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                blocks[data["index"]]["text"] += delta["text"]
            else:
                blocks[data["index"]]["_json"] += delta["partial_json"]
    for block in blocks:
        raw = block.pop("_json")
        if block["type"] == "tool_use":  # (as the SDK reads it: a call cut by max_tokens is partial JSON)
            block["input"] = pydantic_core.from_json(raw, allow_partial="trailing-strings") if raw else {}
    return blocks


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://testserver")


class RateLimitedEngine(ScriptedEngine):
    """Fails every request with the engine's "no pool room" error after ``queue_s`` in the queue."""

    def __init__(self, queue_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.queue_s = queue_s

    def _serve(self, request: GenerationRequest, sink: Any) -> None:
        sink(QueuedEvent(request.request_id, 1))
        time.sleep(self.queue_s)
        usage = Usage(len(request.prompt_tokens), 0, len(request.prompt_tokens), 0)
        sink(FinishEvent(request.request_id, FinishReason.ERROR, usage, error="KV pool exhausted: 8/8 blocks",
                         error_type="rate_limit", retry_after_s=3))


class SlowAdmissionEngine(ScriptedEngine):
    """Admits each request only after ``queue_s``, as when other agents hold the batch."""

    def __init__(self, queue_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.queue_s = queue_s

    def _admit(self, request: GenerationRequest) -> Any:
        time.sleep(self.queue_s)
        return super()._admit(request)
