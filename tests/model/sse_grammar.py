"""Strict checkers for the two streaming grammars (protocol.md), on raw SSE text.

Clients are unforgiving: Claude Code stops reading a stream that refers to
an unopened or already stopped block, and OpenAI SDKs expect one id per
stream and ``[DONE]`` last. Each checker raises AssertionError naming the
first frame that breaks the grammar and returns what the stream said.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DELTA_FOR_BLOCK = {"text": ("text_delta",), "tool_use": ("input_json_delta",),
                   "thinking": ("thinking_delta", "signature_delta")}


@dataclass(frozen=True, slots=True)
class SseEvent:
    name: str | None
    data: str


def parse_sse(text: str) -> list[SseEvent]:
    """Frames split on blank lines; comment lines (``: keep-alive``) are dropped as SSE says."""
    events = []
    for frame in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in frame.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        name = next((line[6:].strip() for line in lines if line.startswith("event:")), None)
        data = "\n".join(line[5:].removeprefix(" ") for line in lines if line.startswith("data:"))
        events.append(SseEvent(name, data))
    return events


# -- Anthropic Messages --------------------------------------------------------------------------
@dataclass(slots=True)
class AnthropicStream:
    """What a valid Messages stream said."""

    start_usage: dict[str, Any] = field(default_factory=dict)
    final_usage: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None
    blocks: list[dict[str, Any]] = field(default_factory=list)
    pings: int = 0

    @property
    def text(self) -> str:
        return "".join(b.get("text", "") for b in self.blocks if b["type"] == "text")


@dataclass(slots=True)
class _AnthropicChecker:
    out: AnthropicStream = field(default_factory=AnthropicStream)
    phase: str = "before_start"  # before_start -> content -> delta_sent -> stopped
    open_block: int | None = None

    def feed(self, event: SseEvent) -> None:
        payload = json.loads(event.data)
        kind = payload.get("type")
        assert event.name == kind, f"event name {event.name!r} but data type {kind!r}"
        if kind == "ping":
            self.out.pings += 1
            return
        assert kind != "error", f"error event: {payload}"
        handler = getattr(self, f"_{kind}", None)
        assert handler is not None, f"unknown event type {kind!r}"
        handler(payload)

    def _expect(self, phase: str, kind: str) -> None:
        assert self.phase == phase, f"{kind} in phase {self.phase} (expected {phase})"

    def _message_start(self, payload: dict[str, Any]) -> None:
        self._expect("before_start", "message_start")
        message = payload["message"]
        assert message["content"] == [] and message["role"] == "assistant", message
        self.out.start_usage = message["usage"]
        self.phase = "content"

    def _content_block_start(self, payload: dict[str, Any]) -> None:
        self._expect("content", "content_block_start")
        assert self.open_block is None, f"block {payload['index']} starts while block {self.open_block} is open"
        expected = len(self.out.blocks)
        assert payload["index"] == expected, f"block index {payload['index']}, expected {expected}"
        self.out.blocks.append(dict(payload["content_block"]))
        self.open_block = payload["index"]

    def _content_block_delta(self, payload: dict[str, Any]) -> None:
        self._expect("content", "content_block_delta")
        assert payload["index"] == self.open_block, f"delta for block {payload['index']}, open: {self.open_block}"
        block, delta = self.out.blocks[payload["index"]], payload["delta"]
        assert delta["type"] in DELTA_FOR_BLOCK[block["type"]], f"{delta['type']} in a {block['type']} block"
        assert not block.get("signature"), "a delta after the thinking block's signature"
        if delta["type"] == "text_delta":
            block["text"] += delta["text"]
        elif delta["type"] == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif delta["type"] == "signature_delta":
            block["signature"] = delta["signature"]

    def _content_block_stop(self, payload: dict[str, Any]) -> None:
        self._expect("content", "content_block_stop")
        assert payload["index"] == self.open_block, f"stop for block {payload['index']}, open: {self.open_block}"
        block = self.out.blocks[payload["index"]]
        assert block["type"] != "thinking" or block.get("signature"), "a thinking block closed without a signature"
        self.open_block = None

    def _message_delta(self, payload: dict[str, Any]) -> None:
        self._expect("content", "message_delta")
        assert self.open_block is None, f"message_delta while block {self.open_block} is open"
        self.out.stop_reason = payload["delta"]["stop_reason"]
        assert self.out.stop_reason, payload
        self.out.final_usage = payload["usage"]
        self.phase = "delta_sent"

    def _message_stop(self, payload: dict[str, Any]) -> None:
        self._expect("delta_sent", "message_stop")
        self.phase = "stopped"


def check_anthropic_stream(text: str) -> AnthropicStream:
    """Validate a whole Messages stream: message_start first, blocks in order, message_delta, message_stop last."""
    checker = _AnthropicChecker()
    for number, event in enumerate(parse_sse(text)):
        assert checker.phase != "stopped", f"frame {number} after message_stop: {event}"
        try:
            checker.feed(event)
        except AssertionError as exc:
            raise AssertionError(f"frame {number} {event}: {exc}\nstream:\n{text}") from None
    assert checker.phase == "stopped", f"stream ended in phase {checker.phase}:\n{text}"
    return checker.out


# -- OpenAI chat completions -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OpenAIStream:
    text: str
    finish_reason: str
    usage: dict[str, Any]


def check_openai_stream(text: str) -> OpenAIStream:
    """One id/created, a role delta first, one finish_reason, a usage chunk, ``[DONE]`` last."""
    events = parse_sse(text)
    assert events and events[-1].data == "[DONE]", f"[DONE] is not the last frame:\n{text}"
    chunks = [json.loads(e.data) for e in events[:-1]]
    assert all(e.data != "[DONE]" for e in events[:-1]), f"[DONE] before the end:\n{text}"
    assert all(c.get("object") == "chat.completion.chunk" for c in chunks), text
    assert len({(c["id"], c["created"]) for c in chunks}) == 1, f"id/created vary:\n{text}"
    *content, usage_chunk = chunks
    assert content and content[0]["choices"][0]["delta"].get("role") == "assistant", f"no role first:\n{text}"
    finishes = [c["choices"][0]["finish_reason"] for c in content if c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and content[-1]["choices"][0]["finish_reason"], f"finish_reason not once, last:\n{text}"
    assert usage_chunk["choices"] == [] and usage_chunk.get("usage"), f"no usage chunk before [DONE]:\n{text}"
    said = "".join(c["choices"][0]["delta"].get("content") or "" for c in content)
    return OpenAIStream(said, finishes[0], usage_chunk["usage"])
