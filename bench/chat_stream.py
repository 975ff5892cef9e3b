"""A timed, streaming OpenAI chat-completions client: the same code for every server compared.

Time to first token is taken at the first chunk with non-empty ``content``:
semantic sends an empty role delta as soon as a turn is admitted, before its
prefill, so the first chunk of any kind would flatter it.

With ``raw_prompts`` it sends each turn to ``/v1/completions`` instead, its
messages' texts joined by blank lines as one prompt: how a base model (no
chat template) is served alike by every server, each continuing the same text
to the token cap or its end token.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

# semantic answers 429 (pool full at admission) and 503 with retry-after; a real client waits and retries.
RETRY_STATUSES = (429, 503)
RETRY_LIMIT = 20
# mlx_lm.server listens with Python's default backlog of 5 and can drop a connection from a burst of
# 16 before reading it (ReadError, nothing logged); the OpenAI SDK retries those, and so does this client.
RETRY_PAUSE_S = 0.5


@dataclass(frozen=True, slots=True)
class Turn:
    """One completed request, with the server's own usage figures."""

    agent: str
    index: int
    text: str
    sent_at: float
    first_token_at: float
    done_at: float
    prompt_tokens: int
    completion_tokens: int
    # None when the server does not say (prompt_tokens_details absent).
    cached_tokens: int | None
    # Requests refused (429/503) or dropped unanswered before this one got through; their wait is in the TTFT.
    retries: int
    # semantic's usage extension (hand-off timings, bytes copied); empty for other servers.
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float:
        return self.first_token_at - self.sent_at


@dataclass(slots=True)
class _StreamState:
    pieces: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    usage: dict[str, Any] | None = None
    retries: int = 0

    def feed(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk:
            raise RuntimeError(f"server error in stream: {chunk['error']}")
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content") or choice.get("text")
            if content:
                self.first_token_at = self.first_token_at or time.perf_counter()
                self.pieces.append(content)


class ChatClient:
    """Streams chat turns to one server; ``session_id`` is sent only where the server understands it."""

    def __init__(self, base_url: str, sends_session_id: bool, timeout_s: float = 3600.0,
                 model: str | None = None, raw_prompts: bool = False) -> None:
        """``model``: the body's model field (which of a server's models serves the turns; None: none sent).
        ``raw_prompts``: turns go to /v1/completions as one raw prompt each."""
        self.sends_session_id = sends_session_id
        self.model = model
        self.raw_prompts = raw_prompts
        # Up to 16 streams at once, plus room for the connections the peer closes after each answer.
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def get_json(self, path: str) -> dict[str, Any]:
        """A GET the server answers with JSON (semantic's ``/v1/stats``)."""
        response = await self._http.get(path)
        response.raise_for_status()
        return response.json()

    async def delete(self, path: str) -> None:
        """A DELETE (semantic's ``/v1/agents/{id}``)."""
        response = await self._http.delete(path)
        response.raise_for_status()

    async def turn(self, agent: str, index: int, messages: list[dict[str, str]], max_tokens: int) -> Turn:
        body: dict[str, Any] = {
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **({"prompt": raw_prompt(messages)} if self.raw_prompts else {"messages": messages}),
        }
        if self.sends_session_id:
            body["session_id"] = agent
        if self.model is not None:
            body["model"] = self.model
        sent_at = time.perf_counter()
        state = _StreamState()
        for _ in range(RETRY_LIMIT):
            response = await self._open(body, state)
            if response is None:
                continue
            try:
                await _read_events(response, state)
            finally:
                await response.aclose()
            return _turn_of(agent, index, sent_at, state)
        raise RuntimeError(f"{agent}: no answer after {RETRY_LIMIT} tries")

    async def _open(self, body: dict[str, Any], state: _StreamState) -> httpx.Response | None:
        """The response once its headers are in; None, after a pause, when the request must be sent again."""
        path = "/v1/completions" if self.raw_prompts else "/v1/chat/completions"
        request = self._http.build_request("POST", path, json=body)
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError:
            return await self._pause(state, RETRY_PAUSE_S)
        if response.status_code in RETRY_STATUSES:
            await response.aclose()
            return await self._pause(state, float(response.headers.get("retry-after", "1")))
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
        return response

    @staticmethod
    async def _pause(state: _StreamState, seconds: float) -> None:
        state.retries += 1
        await asyncio.sleep(seconds)


def raw_prompt(messages: list[dict[str, str]]) -> str:
    """A chat's messages as one text to continue: their contents, a blank line apart, and one to continue after."""
    return "\n\n".join(message["content"] for message in messages) + "\n\n"


async def _read_events(response: httpx.Response, state: _StreamState) -> None:
    async for line in response.aiter_lines():
        # mlx_lm.server also sends ": keepalive n/m" comment lines while it prefills.
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            break
        state.feed(json.loads(data))


def _turn_of(agent: str, index: int, sent_at: float, state: _StreamState) -> Turn:
    done_at = time.perf_counter()
    usage = state.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return Turn(
        agent=agent,
        index=index,
        text="".join(state.pieces),
        sent_at=sent_at,
        # A reply that is only a stop token has no content chunk; its first token is its end.
        first_token_at=state.first_token_at or done_at,
        done_at=done_at,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=details.get("cached_tokens"),
        retries=state.retries,
        cache=usage.get("semantic") or {},
    )
