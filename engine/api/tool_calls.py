"""Finding tool calls in generated text, incrementally, as the text streams.

A tool call is the text between a start and an end marker, parsed by a
function: mlx-lm's tool parser for templates it recognises, else the JSON
(Hermes) format of the rendering fallback. Text that might be the start of
a marker is held back until it is decided, so no client ever sees half a
marker as text.
"""

from __future__ import annotations

import itertools
import json
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from engine.domain.chat import ToolCall
from engine.domain.reasoning import HarmonyFormat, ReasoningFormat

ParseFn = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    start: str
    end: str
    parse: ParseFn
    # The call between the markers is ``{"name": ..., "arguments": ...}`` JSON: strict tools can be
    # constrained to it (tool_constraints.py); other formats (pythonic, XML-ish) cannot, yet.
    json_body: bool = False


def _parse_json_call(text: str, tools: Any = None) -> dict[str, Any]:
    return json.loads(text.strip())


FALLBACK = ToolFormat("<tool_call>", "</tool_call>", _parse_json_call, json_body=True)
# gpt-oss writes calls on a channel of their own (harmony's ``to=functions.NAME`` header), which the engine routes
# apart from the answer (domain/reasoning_tracker.py): there are no markers in the answer text to look for, and
# nothing a grammar over the answer could constrain.
HARMONY_CALLS = ToolFormat("<|start|>assistant to=functions.", "<|call|>", _parse_json_call)
# mlx-lm's parser of JSON calls between <tool_call> markers (Qwen's and Hermes' templates).
JSON_TOOLS_PARSER = "mlx_lm.tool_parsers.json_tools"


def tool_format_for(tokenizer: Any, reasoning: ReasoningFormat | None = None) -> ToolFormat:
    """The model's tool-call format; ``reasoning``: its reasoning format (LoadedModel.reasoning)."""
    if isinstance(reasoning, HarmonyFormat):
        return HARMONY_CALLS
    if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
        parse = tokenizer.tool_parser
        end = tokenizer.tool_call_end or ""
        json_body = getattr(parse, "__module__", None) == JSON_TOOLS_PARSER and bool(end)
        return ToolFormat(tokenizer.tool_call_start, end, parse, json_body)
    return FALLBACK


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class ToolPiece:
    call: ToolCall


@dataclass(frozen=True, slots=True)
class BadToolPiece:
    """A marked tool call that did not parse: surfaced as text so nothing is lost."""

    text: str
    error: str


@dataclass(frozen=True, slots=True)
class ReasoningPiece:
    """Reasoning text (a thinking model's), never parsed for tool calls."""

    text: str


Piece = TextPiece | ToolPiece | BadToolPiece | ReasoningPiece
_counter = itertools.count(1)


def new_tool_id(prefix: str = "toolu_") -> str:
    return f"{prefix}{secrets.token_hex(8)}{next(_counter):04d}"


class ToolCallStream:
    def __init__(self, fmt: ToolFormat, tools: Any = None, id_prefix: str = "toolu_") -> None:
        self.fmt = fmt
        self.tools = tools
        self.id_prefix = id_prefix
        self._buffer = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            piece = self._next_piece()
            if piece is None:
                return pieces
            pieces.append(piece)

    def finish(self) -> list[Piece]:
        """End of generation: an unterminated call is parsed if it can be, else returned as text."""
        pieces = self.feed("")
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            pieces.append(self._parsed(rest, self.fmt.start + rest))
        elif rest:
            pieces.append(TextPiece(rest))
        return pieces

    def _next_piece(self) -> Piece | None:
        if self._in_call:
            return self._close_call()
        at = self._buffer.find(self.fmt.start)
        if at >= 0:
            text, self._buffer = self._buffer[:at], self._buffer[at + len(self.fmt.start):]
            self._in_call = True
            return TextPiece(text) if text else self._next_piece()
        safe = len(self._buffer) - _partial_suffix(self._buffer, self.fmt.start)
        if safe <= 0:
            return None
        text, self._buffer = self._buffer[:safe], self._buffer[safe:]
        return TextPiece(text)

    def _close_call(self) -> Piece | None:
        if not self.fmt.end:
            return None  # formats without an end marker run to the end of generation
        at = self._buffer.find(self.fmt.end)
        if at < 0:
            return None
        body, self._buffer = self._buffer[:at], self._buffer[at + len(self.fmt.end):]
        self._in_call = False
        return self._parsed(body, f"{self.fmt.start}{body}{self.fmt.end}")

    def _parsed(self, body: str, raw: str) -> Piece:
        try:
            parsed = self.fmt.parse(body, self.tools)
            first = parsed[0] if isinstance(parsed, list) else parsed
            arguments = first.get("arguments", first.get("parameters", {}))
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            call = ToolCall(new_tool_id(self.id_prefix), str(first["name"]), dict(arguments))
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            return BadToolPiece(raw, f"{type(exc).__name__}: {exc}")
        self.calls.append(call)
        return ToolPiece(call)


def channel_call(name: str, arguments: str, id_prefix: str) -> Piece:
    """A call written on a channel of its own (harmony's ``to=functions.NAME``): its arguments are the JSON object
    the channel carried. One that does not parse is text, so nothing is lost."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(parsed, dict):
            raise TypeError(f"the arguments are a JSON {type(parsed).__name__}, not an object")
    except (ValueError, TypeError) as exc:
        return BadToolPiece(arguments, f"{type(exc).__name__}: {exc}")
    return ToolPiece(ToolCall(new_tool_id(id_prefix), name, parsed))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
