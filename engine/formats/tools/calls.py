"""Finding tool calls in generated text, incrementally, as the text streams.

A tool call is the text between a start and an end marker, parsed by a
function: mlx-lm's tool parser for templates it recognises, else the JSON
(Hermes) format of the rendering fallback. Text that might be the start of
a marker is held back until it is decided, so no client ever sees half a
marker as text.

A call in a JSON format streams as it is written (``scanning.py``): a
:class:`ToolStartPiece` once its name is known, :class:`ToolArgumentsPiece`
with each new part of its arguments' text, then the :class:`ToolPiece` when
it closes. Other formats give the ``ToolPiece`` alone, at the call's end.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from engine.domain.chat import ToolCall
from engine.domain.reasoning import HarmonyFormat, ReasoningFormat

from .function_gemma import FunctionGemmaCallScanner
from .gemma4 import Gemma4CallScanner
from .glm import GlmCallScanner, LongcatCallScanner
from .headed import HeadedJsonScanner, kimi_header, mistral_header
from .kimi_k3 import KimiK3CallScanner
from .minicpm5 import MiniCpm5CallScanner
from .minimax import MiniMaxCallScanner
from .muse_spark import MuseSparkCallScanner
from .pythonic import PythonicCallScanner
from .scanning import JsonCallScanner, XmlFunctionScanner, partial_arguments, partial_suffix

ParseFn = Callable[[str, Any], Any]
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolFormat:
    start: str
    end: str
    parse: ParseFn
    # The call between the markers is ``{"name": ..., "arguments": ...}`` JSON: strict tools can be
    # constrained to it (tool_constraints.py); other formats (pythonic, XML-ish) cannot, yet.
    json_body: bool = False
    # How a call's arguments stream while it is written (StreamedArguments.of): "json" (a JSON body),
    # "qwen3_xml" (Qwen3-Coder's XML), "glm47" or "longcat" (GLM's or LongCat's keys and values), "minimax_m2" (MiniMax's invoke and
    # parameters), "gemma4" (Gemma 4's bare-keyed JSON), "mistral" or "kimi" (a header, then the arguments' JSON),
    # or None: the call comes whole when it closes.
    streams: str | None = None


def _parse_json_call(text: str, tools: Any = None) -> dict[str, Any]:
    return json.loads(text.strip())


FALLBACK = ToolFormat("<tool_call>", "</tool_call>", _parse_json_call, json_body=True, streams="json")
# gpt-oss writes calls on a channel of their own (harmony's ``to=functions.NAME`` header), which the engine routes
# apart from the answer (domain/reasoning_tracker.py): there are no markers in the answer text to look for, and
# nothing a grammar over the answer could constrain.
HARMONY_CALLS = ToolFormat("<|start|>assistant to=functions.", "<|call|>", _parse_json_call)
# mlx-lm's parser of JSON calls between <tool_call> markers (Qwen's and Hermes' templates).
JSON_TOOLS_PARSER = "mlx_lm.tool_parsers.json_tools"
# Its parser of Qwen3-Coder's XML calls (Qwen3.5's and Qwen3-Next's templates too).
QWEN3_XML_PARSER = "mlx_lm.tool_parsers.qwen3_coder"
# Its parsers whose calls stream in a format of their own, by module (the call's end marker, where the format
# has one, is the tokenizer's): GLM-4.5/4.7's (and Laguna's, the same parser), LongCat's, MiniMax-M2's, Gemma 4's,
# Mistral's (no end marker), Kimi K2's and K3's, LFM2's pythonic calls, FunctionGemma's, MiniCPM5's and Muse Spark's.
STREAMING_PARSERS = {f"mlx_lm.tool_parsers.{module}": streams for module, streams in (
    ("glm47", "glm47"), ("longcat", "longcat"), ("minimax_m2", "minimax_m2"), ("gemma4", "gemma4"),
    ("mistral", "mistral"), ("kimi_k2", "kimi"), ("kimi_k3", "kimi_k3"), ("pythonic", "pythonic"),
    ("function_gemma", "function_gemma"), ("minicpm5", "minicpm5"), ("muse_spark", "muse_spark"))}


def tool_format_for(tokenizer: Any, reasoning: ReasoningFormat | None = None) -> ToolFormat:
    """The model's tool-call format; ``reasoning``: its reasoning format (LoadedModel.reasoning)."""
    if isinstance(reasoning, HarmonyFormat):
        return HARMONY_CALLS
    if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
        parse = tokenizer.tool_parser
        end = tokenizer.tool_call_end or ""
        module = getattr(parse, "__module__", None)
        json_body = module == JSON_TOOLS_PARSER and bool(end)
        streams = ("json" if json_body else "qwen3_xml" if module == QWEN3_XML_PARSER and end
                   else STREAMING_PARSERS.get(module or ""))
        return ToolFormat(tokenizer.tool_call_start, end, parse, json_body, streams)
    return FALLBACK


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class ToolStartPiece:
    """A call whose arguments will stream: its id and name, before any of its arguments."""

    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolArgumentsPiece:
    """The next part of a started call's arguments, as the model wrote it."""

    id: str
    text: str


@dataclass(frozen=True, slots=True)
class ToolPiece:
    """A whole call. ``arguments_text``: for a call that streamed, its arguments' text as streamed (the
    pieces joined), which ``call.arguments`` parses from; None for a call given whole. ``complete`` False: a
    call that streamed and then never closed, or closed arguments that do not parse (the reply ran to its cap):
    the client saw it begin, so it ends as a call with what its arguments hold, but it is no call to run and
    the reply's ending says why it stopped."""

    call: ToolCall
    arguments_text: str | None = None
    complete: bool = True


@dataclass(frozen=True, slots=True)
class BadToolPiece:
    """A marked tool call that did not parse: surfaced as text so nothing is lost."""

    text: str
    error: str


@dataclass(frozen=True, slots=True)
class ReasoningPiece:
    """Reasoning text (a thinking model's), never parsed for tool calls."""

    text: str


Piece = TextPiece | ToolStartPiece | ToolArgumentsPiece | ToolPiece | BadToolPiece | ReasoningPiece
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
        self._arguments: StreamedArguments | None = None  # the open call's, in a format that streams
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            more = self._next_pieces()
            if more is None:
                return pieces
            pieces += more

    def finish(self) -> list[Piece]:
        """End of generation: an unterminated call is parsed if it can be, else returned as text (a call that
        streamed stays a call, with the arguments it got)."""
        pieces = self.feed("")
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            if self._arguments is not None:  # a format without an end marker ends here; another's was cut short
                pieces += self._arguments.take(rest, len(rest), ended=not self.fmt.end)
            pieces += self._parsed(rest, self.fmt.start + rest)
        elif rest:
            pieces.append(TextPiece(rest))
        return pieces

    def _next_pieces(self) -> list[Piece] | None:
        if self._in_call:
            return self._close_call()
        at = self._buffer.find(self.fmt.start)
        if at >= 0:
            text, self._buffer = self._buffer[:at], self._buffer[at + len(self.fmt.start):]
            self._in_call = True
            self._arguments = StreamedArguments.of(self.fmt, self.tools, self.id_prefix)
            return [TextPiece(text)] if text else []
        safe = len(self._buffer) - partial_suffix(self._buffer, self.fmt.start)
        if safe <= 0:
            return None
        text, self._buffer = self._buffer[:safe], self._buffer[safe:]
        return [TextPiece(text)]

    def _close_call(self) -> list[Piece] | None:
        if not self.fmt.end:  # formats without an end marker run to the end of generation, streaming as they go
            if self._arguments is None:
                return None
            return self._arguments.take(self._buffer, len(self._buffer)) or None
        at = self._buffer.find(self.fmt.end)
        if at < 0:  # still open: what is surely before the end marker may stream
            if self._arguments is None:
                return None
            sure = len(self._buffer) - partial_suffix(self._buffer, self.fmt.end)
            return self._arguments.take(self._buffer, sure) or None
        body, self._buffer = self._buffer[:at], self._buffer[at + len(self.fmt.end):]
        self._in_call = False
        pieces = self._arguments.take(body, len(body), ended=True) if self._arguments is not None else []
        return pieces + self._parsed(body, f"{self.fmt.start}{body}{self.fmt.end}")

    def _parsed(self, body: str, raw: str) -> list[Piece]:
        """The calls the body holds: the first (the one that streamed, if it did), then any further ones whole
        (a Kimi or MiniMax section, or Mistral's run of calls, may hold several)."""
        streamed, self._arguments = self._arguments, None
        try:
            parsed = self.fmt.parse(body, self.tools)
            calls = [self._call(one) for one in (parsed if isinstance(parsed, list) else [parsed])]
            if not calls:
                raise ValueError("no call")
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            if streamed is None or streamed.started is None:
                return [BadToolPiece(raw, f"{type(exc).__name__}: {exc}")]
            calls = [None]  # a call the client has seen begin stays one: with the arguments it got
        first = (streamed.ended(calls[0]) if streamed is not None and streamed.started is not None
                 else ToolPiece(calls[0]))
        pieces: list[Piece] = [first, *(ToolPiece(call) for call in calls[1:] if call is not None)]
        self.calls += [piece.call for piece in pieces if isinstance(piece, ToolPiece) and piece.complete]
        return pieces

    def _call(self, parsed: Any) -> ToolCall:
        arguments = parsed.get("arguments", parsed.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        return ToolCall(new_tool_id(self.id_prefix), str(parsed["name"]), dict(arguments))


ArgumentScanner = (JsonCallScanner | XmlFunctionScanner | GlmCallScanner | MiniMaxCallScanner | Gemma4CallScanner
                   | HeadedJsonScanner | PythonicCallScanner | FunctionGemmaCallScanner | MiniCpm5CallScanner
                   | KimiK3CallScanner | MuseSparkCallScanner)


class StreamedArguments:
    """One call's arguments streaming: its format's scanner (scanning.py) over its body as it grows."""

    def __init__(self, id_prefix: str, scanner: ArgumentScanner) -> None:
        self.id_prefix = id_prefix
        self.scanner = scanner
        self.started: ToolStartPiece | None = None
        self.text = ""  # the arguments' text streamed so far
        self._read = 0  # how much of the body the scanner has read

    @classmethod
    def of(cls, fmt: ToolFormat, tools: Any, id_prefix: str) -> "StreamedArguments | None":
        """For a call of ``fmt`` (None: its format does not stream)."""
        scanners: dict[str, Callable[[], ArgumentScanner]] = {
            "json": JsonCallScanner, "qwen3_xml": lambda: XmlFunctionScanner(tools),
            "glm47": lambda: GlmCallScanner(tools), "longcat": lambda: LongcatCallScanner(tools),
            "minimax_m2": lambda: MiniMaxCallScanner(tools), "gemma4": Gemma4CallScanner,
            "mistral": lambda: HeadedJsonScanner(mistral_header), "kimi": lambda: HeadedJsonScanner(kimi_header),
            "kimi_k3": lambda: KimiK3CallScanner(tools), "pythonic": lambda: PythonicCallScanner(tools),
            "function_gemma": lambda: FunctionGemmaCallScanner(tools), "minicpm5": lambda: MiniCpm5CallScanner(tools),
            "muse_spark": lambda: MuseSparkCallScanner(tools)}
        make = scanners.get(fmt.streams or "")
        return cls(id_prefix, make()) if make is not None else None

    def take(self, body: str, upto: int, ended: bool = False) -> list[Piece]:
        """Pieces for the body's text up to ``upto`` not read before; ``ended``: that is the whole body."""
        try:
            fresh = self.scanner.feed(body[self._read:upto]) if upto > self._read else ""
            if ended:
                fresh += self.scanner.close()
        except Exception:  # a scanner's fault must not end the reply: a call not begun comes whole from its parser
            log.warning("tool-call arguments stopped streaming: %s failed on the model's text",
                        type(self.scanner).__name__, exc_info=True)
            self.scanner.refused, fresh = True, ""
        self._read = max(self._read, upto)
        pieces: list[Piece] = []
        if fresh and self.started is None:
            self.started = ToolStartPiece(new_tool_id(self.id_prefix), str(self.scanner.name))
            pieces.append(self.started)
        if fresh:
            self.text += fresh
            pieces.append(ToolArgumentsPiece(self.started.id, fresh))
        return pieces

    def ended(self, parsed: ToolCall | None) -> ToolPiece:
        """The started call, whole: its arguments are what streamed (equal to the parsed call's, which the
        body as a whole gave; a call that never closed has what its text holds so far)."""
        assert self.started is not None
        try:
            arguments = json.loads(self.text) if parsed is not None and self.scanner.done else None
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            return ToolPiece(ToolCall(self.started.id, self.started.name, partial_arguments(self.text)), self.text,
                             complete=False)
        return ToolPiece(ToolCall(self.started.id, self.started.name, arguments), self.text)


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
