"""Recorded Claude Code turns whose answer is a file written back: loading them and timing a server's answer.

``bench/traces/claude_code_write_turns.jsonl`` holds sessions recorded by
``record_claude_code.py --write-turn``: per session, the CLI's request after
its ``Read`` of a source file, asking for a rename across it (the turn whose
answer, from a model that follows the ask, is a ``Write`` of the whole file).
Each is sent as its client sent it: semantic gets the Anthropic Messages
request with the CLI's headers; a server that speaks only OpenAI chat gets
the same conversation translated (``trace_format.to_openai``), as
``replay.py`` sends it. Greedy (temperature 0), so the answers of two servers
on one model can be compared text for text, and capped at ``max_tokens``.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench.chat_stream import Turn
from bench.replay import outgoing, usage_tokens
from bench.trace_format import Recorded, load_trace, sessions, tool_results

TRACE = Path(__file__).resolve().parent / "traces" / "claude_code_write_turns.jsonl"
API_KEY = "bench"


def write_turns(path: Path = TRACE) -> list[Recorded]:
    """Per recorded session, its request carrying one tool result (the file as the CLI's ``Read`` gave it)."""
    turns = []
    for requests in sessions(load_trace(path)).values():
        for request in requests:
            if tool_results(request.body) == 1 and any(t.get("name") == "Write" for t in request.body.get("tools", ())):
                turns.append(request)
                break
    if not turns:
        raise SystemExit(f"{path}: no request after a Read in any session (record it with "
                         "bench/record_claude_code.py --write-turn)")
    return turns


async def send_write_turn(http: httpx.AsyncClient, request: Recorded, protocol: str, agent: str,
                          max_tokens: int) -> Turn:
    """One recorded turn, streamed; ``agent`` replaces the CLI's session id, so every run starts a fresh agent.

    The text compared across servers is what the model wrote: text, and tool calls' names and arguments, as
    they stream.
    """
    recorded = replace(request, headers={**request.headers, "x-claude-code-session-id": agent},
                       body={**request.body, "temperature": 0}, session=agent)
    path, headers, body = outgoing(recorded, protocol, max_tokens, API_KEY)
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    first_at = None
    sent_at = time.perf_counter()
    async with http.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{agent}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            piece = _piece(event, protocol, usage)
            if piece:
                first_at = first_at or time.perf_counter()
                pieces.append(piece)
    done_at = time.perf_counter()
    prompt, _, generated = usage_tokens(usage, protocol)
    return Turn(agent=agent, index=0, text="".join(pieces), sent_at=sent_at, first_token_at=first_at or done_at,
                done_at=done_at, prompt_tokens=prompt, completion_tokens=generated, cached_tokens=None, retries=0)


def _piece(event: dict[str, Any], protocol: str, usage: dict[str, Any]) -> str:
    """The generated text an event carries (usage figures are gathered into ``usage`` on the way)."""
    if protocol == "anthropic":
        kind = event.get("type")
        if kind == "error":
            raise RuntimeError(f"stream error: {event.get('error')}")
        if kind == "message_start":
            usage.update(event["message"].get("usage") or {})
        elif kind == "content_block_start" and event["content_block"].get("type") == "tool_use":
            return event["content_block"].get("name") or ""  # as the OpenAI stream carries it, before its arguments
        elif kind == "message_delta":
            usage.update(event.get("usage") or {})
        elif kind == "content_block_delta":
            delta = event["delta"]
            return delta.get("text") or delta.get("partial_json") or delta.get("thinking") or ""
        return ""
    if "error" in event:
        raise RuntimeError(f"stream error: {event['error']}")
    usage.update(event.get("usage") or {})
    text = ""
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        text += delta.get("content") or delta.get("reasoning") or ""
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            text += (function.get("name") or "") + (function.get("arguments") or "")
    return text


async def agent_row(http: httpx.AsyncClient, agent: str) -> dict[str, Any]:
    """semantic's ``/v1/stats`` row for the agent a Claude Code session id names (fresh, so its figures are this
    turn's: speculation, and ``last_ttft_s``, the time from the engine taking the turn to its first token)."""
    response = await http.get("/v1/stats")
    response.raise_for_status()
    for row in response.json().get("agents") or ():
        if row.get("agent_id", "").startswith(f"cc-{agent}-"):
            return row
    raise RuntimeError(f"/v1/stats has no agent for Claude Code session {agent}")
