"""A reader of ``GET /v1/stream`` for tests: frames as they arrive, each with the moment it was parsed."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx


@dataclass(frozen=True, slots=True)
class Frame:
    event: str  # "hello", "stats", "log", "dropped"; "" for a comment (keep-alive)
    data: Any
    id: str | None
    at: float  # time.monotonic() when it was read


def parse_frame(raw: str, at: float) -> Frame:
    event, data, event_id = "", [], None
    for line in raw.split("\n"):
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            event_id = value
    return Frame(event, json.loads("\n".join(data)) if data else None, event_id, at)


async def frames(response: httpx.Response) -> AsyncIterator[Frame]:
    """The response's frames in order, keep-alive comments included (event "")."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        while "\n\n" in buffer:
            raw, buffer = buffer.split("\n\n", 1)
            yield parse_frame(raw, time.monotonic())


async def next_frame(stream: AsyncIterator[Frame], *events: str) -> Frame:
    """The next frame of one of ``events`` (skipping the others)."""
    async for frame in stream:
        if frame.event in events:
            return frame
    raise AssertionError(f"the stream ended before a frame of {events}")
