"""Reading a semantic server's answers as a client: server-sent events, and the message of an error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import httpx


@dataclass(slots=True)
class SseFrame:
    event: str
    data: str
    id: str | None = None


async def sse_frames(lines: AsyncIterator[str]) -> AsyncIterator[SseFrame]:
    """Server-sent events from a response's lines (comments, the keep-alives, skipped)."""
    event, data, frame_id = "message", [], None
    async for line in lines:
        if not line:
            if data:
                yield SseFrame(event, "\n".join(data), frame_id)
            event, data, frame_id = "message", [], None
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
            elif name == "id":
                frame_id = value


def error_message(response: httpx.Response) -> str:
    """The message of an error answer in either of the API's shapes (Anthropic's or OpenAI's)."""
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return f"HTTP {response.status_code}"
