"""Recorded client traffic: reading a trace, grouping it into sessions, and
translating Anthropic Messages and OpenAI Responses bodies for servers that speak only OpenAI chat.

A trace is JSONL, one request per line, as ``semantic --record-requests PATH``
writes it (``t``, ``duration_s``, ``status``, ``method``, ``path``,
``headers``, ``body``) or as ``bench/record_claude_code.py`` writes it (no
timing: its requests replay back to back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATION_PATHS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
# Headers a replay must not resend: they describe the recorded connection, not the request.
CONNECTION_HEADERS = frozenset({"host", "content-length", "accept-encoding", "connection", "transfer-encoding"})
SESSION_HEADERS = ("x-claude-code-session-id", "x-semantic-agent-id")


@dataclass(frozen=True, slots=True)
class Recorded:
    """One generation request of a trace."""

    line: int  # 1-based line in the trace file, for error messages
    t: float | None  # seconds after the recording started; None in untimed traces
    duration_s: float | None  # how long the recorded server took to answer it
    path: str  # with its query string, as sent
    headers: dict[str, str]
    body: dict[str, Any]
    session: str

    @property
    def protocol(self) -> str:
        """anthropic, responses (the OpenAI Responses API: Codex CLI) or openai (chat completions)."""
        if self.path.startswith("/v1/messages"):
            return "anthropic"
        return "responses" if self.path.startswith("/v1/responses") else "openai"

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))


class TraceError(ValueError):
    """A trace line that cannot be replayed, named by its line number."""


def load_trace(path: Path) -> list[Recorded]:
    """The trace's generation requests (count_tokens and admin calls left out), in the order they were sent."""
    requests = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError as exc:
            raise TraceError(f"{path}:{number}: not JSON ({exc})") from exc
        request = _generation_request(record, number)
        if request is not None:
            requests.append(request)
    if any(r.t is not None for r in requests):
        requests.sort(key=lambda r: (r.t if r.t is not None else 0.0, r.line))
    return requests


def _generation_request(record: Any, number: int) -> Recorded | None:
    if not isinstance(record, dict):
        raise TraceError(f"line {number}: expected a JSON object, got {type(record).__name__}")
    path = record.get("path")
    if not isinstance(path, str):
        raise TraceError(f"line {number}: missing 'path'")
    route = path.split("?", 1)[0]
    if record.get("method", "POST") != "POST" or route not in GENERATION_PATHS:
        return None
    body = record.get("body")
    if not isinstance(body, dict):
        # Requests the server refused are kept (a replay refuses them again); bodies that were not JSON are not.
        raise TraceError(f"line {number}: {route} without a JSON object body")
    headers = {str(k).lower(): str(v) for k, v in (record.get("headers") or {}).items()}
    t, duration = record.get("t"), record.get("duration_s")
    return Recorded(number, float(t) if t is not None else None, float(duration) if duration is not None else None,
                    path, {k: v for k, v in headers.items() if k not in CONNECTION_HEADERS}, body,
                    session_of(headers, body))


def session_of(headers: dict[str, str], body: dict[str, Any]) -> str:
    """Which conversation a request belongs to: requests of one session are replayed in order, one at a time."""
    for name in SESSION_HEADERS:
        if headers.get(name):
            return headers[name]
    for key in ("session_id", "prompt_cache_key"):  # chat completions; the Responses API (Codex's thread id)
        if isinstance(body.get(key), str):
            return body[key]
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        return metadata["user_id"]
    return "default"


def tool_results(body: dict[str, Any]) -> int:
    """How many tool results an Anthropic Messages body's conversation carries (how far a scripted session got)."""
    return sum(1 for message in body.get("messages") or () if isinstance(message, dict)
               and isinstance(message.get("content"), list)
               for block in message["content"] if isinstance(block, dict) and block.get("type") == "tool_result")


def sessions(requests: list[Recorded]) -> dict[str, list[Recorded]]:
    grouped: dict[str, list[Recorded]] = {}
    for request in requests:
        grouped.setdefault(request.session, []).append(request)
    return grouped


# -- Anthropic Messages -> OpenAI chat completions ------------------------------------------------


def to_openai(body: dict[str, Any], protocol: str = "anthropic") -> dict[str, Any]:
    """The same conversation as an OpenAI chat body: system first, tool calls and results as OpenAI shapes."""
    if protocol == "responses":
        return responses_to_openai(body)
    messages: list[dict[str, Any]] = []
    system = _text_of(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            messages.extend(_openai_messages(message))
    out: dict[str, Any] = {"messages": messages, "max_tokens": body.get("max_tokens", 256),
                           "stream": bool(body.get("stream"))}
    for key in ("temperature", "top_p", "top_k"):
        if key in body:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    tools = [t for t in body.get("tools") or () if "input_schema" in t]
    if tools:
        out["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                          "parameters": t["input_schema"]}} for t in tools]
    return out


def _openai_messages(message: dict[str, Any]) -> list[dict[str, Any]]:
    role, content = message.get("role", "user"), message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = content or []
    if role == "assistant":
        calls = [{"id": b["id"], "type": "function",
                  "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}}
                 for b in blocks if b.get("type") == "tool_use"]
        out: dict[str, Any] = {"role": "assistant", "content": _text_of(blocks)}
        if calls:
            out["tool_calls"] = calls
        return [out]
    results = [{"role": "tool", "tool_call_id": b.get("tool_use_id", ""), "content": _text_of(b.get("content"))}
               for b in blocks if b.get("type") == "tool_result"]
    text = _text_of([b for b in blocks if b.get("type") != "tool_result"])
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")


# -- OpenAI Responses -> OpenAI chat completions ----------------------------------------------------


def responses_to_openai(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API body (Codex's) as a chat body: instructions and developer messages as system
    messages, function_call items as an assistant's tool calls, their outputs as tool messages; reasoning
    items and hosted tools (web_search) left out, as semantic leaves them out of the prompt."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items or ():
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role", "user"), item.get("role", "user"))
            content = item.get("content")
            text = content if isinstance(content, str) else "\n".join(
                p.get("text", "") for p in content or () if isinstance(p, dict))
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                             "content": output if isinstance(output, str) else json.dumps(output)})
    out: dict[str, Any] = {"messages": messages, "max_tokens": body.get("max_output_tokens") or 256,
                           "stream": bool(body.get("stream"))}
    for key in ("temperature", "top_p"):
        if key in body:
            out[key] = body[key]
    tools = [t for t in body.get("tools") or () if t.get("type") == "function"]
    if tools:
        out["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                          "parameters": t.get("parameters") or {}}} for t in tools]
    return out
