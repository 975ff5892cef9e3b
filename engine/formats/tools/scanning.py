"""A tool call's arguments as the model writes them: the JSON object's text, piece by piece.

The JSON call formats (Hermes' and Qwen's ``{"name": ..., "arguments": {...}}``
between ``<tool_call>`` markers, and semantic's fallback of the same shape)
name the tool, then write its arguments as a JSON object. :class:`JsonCallScanner`
reads the call's body as it grows and says the name once its string is
closed, then hands out the arguments object's own text as written (from its
``{`` to the matching ``}``), so a client sees a long ``Write`` take shape
instead of waiting for the call's end. Concatenated, the pieces are that
object's text, which parses to the call's arguments. :class:`XmlFunctionScanner`
does the same for Qwen3-Coder's XML calls, writing the JSON object mlx-lm's
parser makes of them.

A call it cannot stream that way (the arguments before the name, or written
as a string holding JSON) is left whole: the call streams once it closes.

The other formats' scanners live beside this module, one per format, each
following its mlx-lm parser: ``glm`` (GLM, LongCat), ``minimax``,
``gemma4``, ``headed`` (Mistral, Kimi K2), ``pythonic`` (LFM2),
``function_gemma``, ``minicpm5``, ``kimi_k3`` and ``muse_spark``; the
tag-written ones share :class:`TaggedCallScanner` here (the last five
:class:`CheckedCallScanner`, MiniCPM5's and Muse Spark's its
:class:`TaggedValueScanner`), every one :func:`partial_suffix` and
:func:`escaped`.

:func:`partial_arguments` reads what a call that never closed (the reply
ran to its cap) had streamed, as the SDKs' own partial parsers read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import pydantic_core

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class JsonCallScanner:
    """Reads ``{"name": ..., "arguments": {...}}`` text; :meth:`feed` returns the new part of the arguments'
    text, once the name is known (``name``); ``streaming`` while they are being written; ``refused`` once the
    call turned out not to stream (the caller then waits for its end)."""

    name: str | None = None
    streaming: bool = False
    refused: bool = False
    done: bool = False  # the arguments object closed
    _depth: int = 0  # of the call object: 0 before its "{", then 1
    _escaped: bool = False
    _object: "JsonObjectEnd" = field(default_factory=lambda: JsonObjectEnd())
    _string: list[str] = field(default_factory=list)  # a depth-1 string being read (a key or the name's value)
    _key: str | None = None  # the depth-1 key whose value comes next
    _after_colon: bool = False
    _reading: str | None = None  # "key" or "name" while a depth-1 string is read

    def feed(self, text: str) -> str:
        out: list[str] = []
        at = 0
        while at < len(text) and not (self.refused or self.done):
            if self.streaming:
                piece = self._object.take(text[at:])
                out.append(piece)
                at += len(piece)
                if self._object.closed:
                    self.streaming, self.done = False, True
                continue
            char = text[at]
            at += 1
            self._outer(char)
            if self.streaming:
                out.append(self._object.take(char))  # the arguments' "{"
        return "".join(out)

    def close(self) -> str:
        """The call's body ended; the arguments' own ``}`` already said where they end."""
        return ""

    # The call object itself (depth 0 and 1): its keys, the name's value, where the arguments begin.
    def _outer(self, char: str) -> None:
        if self._reading is not None:
            self._read_string(char)
            return
        if char.isspace():
            return
        if self._depth == 0:
            if char == "{":
                self._depth = 1
            else:
                self.refused = True  # not a JSON object: the whole call is parsed at its end
            return
        if self._key is None:
            if char == '"':
                self._reading, self._string = "key", []
            elif char not in ",}":
                self.refused = True
            return
        if not self._after_colon:
            self._after_colon = char == ":"
            self.refused = not self._after_colon
            return
        self._value_starts(char)

    def _value_starts(self, char: str) -> None:
        key, self._key, self._after_colon = self._key, None, False
        if key == "name" and char == '"' and self.name is None:
            self._reading, self._string = "name", []
        elif key in ARGUMENT_KEYS and char == "{" and self.name is not None:
            self.streaming, self._object = True, JsonObjectEnd()
        else:
            self.refused = True  # another key first, arguments before the name, or arguments as a string

    def _read_string(self, char: str) -> None:
        if self._escaped:
            self._escaped = False
            self._string.append(char)
        elif char == "\\":
            self._escaped = True
            self._string.append(char)
        elif char == '"':
            value = json.loads('"' + "".join(self._string) + '"')
            if self._reading == "key":
                self._key = value
            else:
                self.name = value
            self._reading = None
        else:
            self._string.append(char)

class JsonObjectEnd:
    """Where a JSON object written piece by piece ends: :meth:`take` returns the part of the text that belongs
    to it (all of it, or up to its closing brace, then ``closed``). Only the nesting matters, and strings may
    hold braces."""

    def __init__(self) -> None:
        self.closed = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def take(self, text: str) -> str:
        for at, char in enumerate(text):
            if self.closed:
                return text[:at]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                self.closed = self._depth == 0
        return text


def partial_arguments(text: str) -> dict[str, Any]:
    """What an unfinished arguments object holds so far (an unclosed string counts as written), as the
    Anthropic SDK's partial parser reads ``input_json_delta``s; ``{}`` when nothing of it reads."""
    try:
        value = pydantic_core.from_json(text, allow_partial="trailing-strings") if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ScannerState:
    """What every arguments scanner says about its call: ``name`` once known, ``streaming`` while the arguments
    are being written, ``done`` once they closed, ``refused`` once the call turned out not to stream."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.streaming = False
        self.refused = False
        self.done = False

    def close(self) -> str:
        """The call's body ended; its own end already closed the object (else the call ends incomplete)."""
        return ""


class TaggedCallScanner(ScannerState):
    """What the scanners of calls written in tags share (Qwen3-Coder's XML here, GLM's and MiniMax's in their
    own modules): the body read as it grows by a state machine (``STEPS``: each state's method returns the
    arguments' text it writes, "" to go on, or None to wait for more), and the object's members written one
    by one, a string's key and opening quote once its text begins."""

    STEPS: dict[str, str] = {}  # state -> method name; the first is where a call starts

    def __init__(self, tools: Any = None) -> None:
        super().__init__()
        self._tools = tools
        self._buffer = ""
        self._state = next(iter(self.STEPS))
        self._key: str | None = None  # the open value's
        self._value = ""  # the open value's text read so far and not yet sent (a string's) or kept (another's)
        self._opened = False  # the open string value's key and opening quote sent
        self._members = ObjectMembers()

    def feed(self, text: str) -> str:
        self._buffer += text
        out: list[str] = []
        while not (self.refused or self.done):
            step = getattr(self, self.STEPS[self._state])()
            if step is None:
                break
            out.append(step)
        return "".join(out)

    def _open_string(self) -> str:
        if self._opened:
            return ""
        self._opened = True
        return self._members.key(self._key) + '"'

    def _stripped_text(self) -> str | None:
        """The open string value's text that is sure, for a parser that strips its values: leading whitespace
        dropped before the string opens, trailing whitespace held back (it may be the end)."""
        if not self._opened:
            self._value = self._value.lstrip()
        sendable = self._value.rstrip()
        if not sendable:
            return None
        self._value = self._value[len(sendable):]
        return self._open_string() + escaped(sendable)

    def _member(self, key: str | None, value: Any) -> str:
        """A closed value as its member of the object; a value JSON cannot hold (a set, bytes, which a parser's
        literal reading may give) refuses the call: the parser's call ends incomplete."""
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            self.refused = True
            return ""
        return self._members.key(key) + text


class CheckedCallScanner(TaggedCallScanner):
    """A tagged scanner that keeps the call's text (``_written``) and what it sent, and checks the object against
    its parser's own reading of the call when the object closes: the parsers it serves read a call by more than
    each value's own text (LFM2's falls back to a regex when the whole is not Python; Kimi K3's lets a JSON block
    anywhere in the call win), so a call the scanner could not foresee ends incomplete, never wrong."""

    def __init__(self, tools: Any = None) -> None:
        super().__init__(tools)
        self._written = ""
        self._sent: list[str] = []

    def feed(self, text: str) -> str:
        self._written += text
        self._buffer += text
        start = len(self._sent)
        while not (self.refused or self.done):
            step = getattr(self, self.STEPS[self._state])()
            if step is None:
                break
            self._sent.append(step)
        return "".join(self._sent[start:])

    def _head_match(self, pattern: Any) -> Any:
        """``pattern`` (a ``regex`` pattern) matched whole at the start of the text; None while it may still
        match (more text to come) or never can (the call is then refused: it comes whole from its parser)."""
        match = pattern.match(self._buffer, partial=True)
        if match is None:
            self.refused = True
        return match if match is not None and not match.partial else None

    def _checked(self, closing: str, read: Callable[[], Any]) -> str:
        """``closing`` (the object's last text, not yet sent) if the object it ends is the arguments of the first
        call ``read`` gives (the parser on the call's text), under this call's name; else the call is refused."""
        try:
            parsed = read()
            call = parsed[0] if isinstance(parsed, list) else parsed
            agrees = call["name"] == self.name and same_arguments("".join(self._sent) + closing, call["arguments"])
        except (ValueError, TypeError, KeyError, IndexError, SyntaxError):
            agrees = False
        if not agrees:
            self.refused = True
            return ""
        self.streaming, self.done = False, True
        return closing


class TaggedValueScanner(CheckedCallScanner):
    """A checked scanner of calls whose every value runs to an end tag (``VALUE_END``: MiniCPM5's
    ``</param>``, Muse Spark's ``</atem:parameter>``), read by the parser whole once it closes: a value that
    can only be a string streams (its key and text, JSON-escaped) while it is written, any other goes once
    it closes; the object closes when the call's body ends. A subclass says which text of an open value is
    surely its string (:meth:`_sure_text`), what the parser makes of a closed one (:meth:`_read_value`) and
    of the whole call (:meth:`_read_call`)."""

    VALUE_END = ""

    def __init__(self, tools: Any = None) -> None:
        super().__init__(tools)
        self._sent_value = ""  # the open string value's text sent so far

    def close(self) -> str:
        """The call's body ended: the object closes, unless a value was left open (the parser drops that
        parameter, which has partly streamed: the call ends incomplete)."""
        if not self.streaming:
            return ""
        if self._state == "value" and self._opened:
            self.refused = True
            return ""
        return self._checked("}", self._read_call)

    def _begin_value(self, key: str, rest: str) -> str:
        self._key, self._buffer, self._state = key, rest, "value"
        self._value, self._opened, self._sent_value = "", False, ""
        return ""

    def _value_text(self) -> str | None:
        end = self._buffer.find(self.VALUE_END)
        if end >= 0:
            self._value += self._buffer[:end]
            self._buffer, self._state = self._buffer[end + len(self.VALUE_END):], "parameters"
            return self._closed_value()
        sure = len(self._buffer) - partial_suffix(self._buffer, self.VALUE_END)
        self._value, self._buffer = self._value + self._buffer[:sure], self._buffer[sure:]
        text = self._sure_text()
        if text is None or text == self._sent_value:
            return None
        fresh, self._sent_value = text[len(self._sent_value):], text
        return self._open_string() + escaped(fresh)

    def _closed_value(self) -> str:
        key, self._key = self._key, None
        value = self._read_value(key)
        if not self._opened:
            return self._member(key, value)
        if isinstance(value, str) and value.startswith(self._sent_value):
            return escaped(value[len(self._sent_value):]) + '"'
        self.refused = True  # the parser read the value as other than the text that streamed
        return ""

    def _sure_text(self) -> str | None:
        raise NotImplementedError

    def _read_value(self, key: str | None) -> Any:
        raise NotImplementedError

    def _read_call(self) -> Any:
        raise NotImplementedError


class XmlFunctionScanner(TaggedCallScanner):
    """Reads Qwen3-Coder's XML call (mlx-lm's ``qwen3_coder`` parser; Qwen3.5 and Qwen3-Next write it):

        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        ...
        </function>

    and writes the arguments as the JSON object the parser makes of it, as it goes: ``{`` once the name is
    known, each parameter's key when it begins, a string parameter's text (JSON-escaped) as it is written, a
    typed one (a number, a boolean, an object) once it closes, through the parser's own conversion, and ``}``
    at ``</function>``. Held back only what may still change: a possible end tag, the one newline the parser
    trims from a value's end, and a value that may yet be exactly ``null`` (which the parser reads as None).
    """

    FUNCTION, PARAMETER, PARAMETER_END, FUNCTION_END = "<function=", "<parameter=", "</parameter>", "</function>"

    STEPS = {"head": "_head", "parameters": "_parameters", "value": "_value_text"}

    def __init__(self, tools: Any = None) -> None:
        from mlx_lm.tool_parsers import qwen3_coder  # (the parser whose reading this follows)

        super().__init__(tools)
        self._parser = qwen3_coder
        self._config: dict[str, Any] = {}
        self._fresh = False  # nothing of its value read yet (its first newline is dropped)

    def _head(self) -> str | None:
        text = self._buffer.lstrip()
        if not text.startswith(self.FUNCTION):
            self.refused = not self.FUNCTION.startswith(text)
            return None
        rest = text[len(self.FUNCTION):]
        if not any(c in rest for c in "<>\n"):
            return None  # the name is still being written
        match = self._parser._name_regex.match(rest)
        if match is None:
            self.refused = True
            return None
        self.name, self._buffer = match.group(1), rest[match.end():]
        self._config = self._parser._get_arguments_config(self.name, self._tools)
        self.streaming, self._state = True, "parameters"
        return "{"

    def _parameters(self) -> str | None:
        at = self._buffer.find("<")
        if at < 0:
            self._buffer = ""  # text between parameters is not read by the parser either
            return None
        self._buffer = self._buffer[at:]
        if self._buffer.startswith(self.FUNCTION_END):
            self._buffer, self.done, self.streaming = self._buffer[len(self.FUNCTION_END):], True, False
            return "}"
        if self._buffer.startswith(self.PARAMETER):
            rest = self._buffer[len(self.PARAMETER):]
            if not any(c in rest for c in "<>\n"):
                return None
            match = self._parser._name_regex.match(rest)
            if match is None:
                self._buffer = rest
                return ""
            self._key, self._buffer = match.group(1), rest[match.end():]
            self._value, self._opened, self._fresh, self._state = "", False, True, "value"
            return ""
        if self.PARAMETER.startswith(self._buffer) or self.FUNCTION_END.startswith(self._buffer):
            return None  # a tag still being written
        self._buffer = self._buffer[1:]
        return ""

    def _value_text(self) -> str | None:
        if self._fresh:
            if not self._buffer:
                return None
            self._fresh = False
            if self._buffer.startswith("\n"):
                self._buffer = self._buffer[1:]  # the parser drops a value's first newline
        end = self._buffer.find(self.PARAMETER_END)
        if end >= 0:
            self._value += self._buffer[:end]
            self._buffer = self._buffer[end + len(self.PARAMETER_END):]
            self._state = "parameters"
            return self._closed_value()
        held = partial_suffix(self._buffer, self.PARAMETER_END)
        self._value += self._buffer[:len(self._buffer) - held]
        self._buffer = self._buffer[len(self._buffer) - held:]
        if not self._streams_as_string():
            return None
        sendable = self._value[:-1] if self._value.endswith("\n") else self._value  # may be the trimmed newline
        if "null".startswith(sendable.lower()):
            return None  # may yet be exactly "null"
        out = self._open_string() + escaped(sendable)
        self._value = self._value[len(sendable):]
        return out or None

    def _closed_value(self) -> str:
        value = self._value[:-1] if self._value.endswith("\n") else self._value
        key, self._key = self._key, None
        if self._opened:
            return escaped(value) + '"'
        try:
            converted = self._parser._convert_param_value(value, key, self._config)
        except (ValueError, SyntaxError):
            self.refused = True  # the parser fails the whole call on it: what streamed ends incomplete
            return ""
        return self._members.key(key) + json.dumps(converted, ensure_ascii=False)

    def _streams_as_string(self) -> bool:
        """Whether the parser keeps this parameter's value as the text written (its schema says a string, or
        the tool does not describe it)."""
        param = self._config.get(self._key)
        if not param:
            return True
        return "type" in param and str(param["type"]).strip().lower() in self._parser._string_types

class ObjectMembers:
    """The members of a JSON object written one by one: each key after a comma but the first's."""

    def __init__(self) -> None:
        self._first = True

    def key(self, key: str | None) -> str:
        first, self._first = self._first, False
        return ("" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": "


def escaped(text: str) -> str:
    """``text`` as it stands inside a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def same_arguments(sent: str, arguments: Any) -> bool:
    """Whether the arguments' text sent parses to ``arguments`` as JSON carries them (a tuple as a list, NaN as
    NaN): what a client holds once it joins the pieces."""
    try:
        return json.dumps(json.loads(sent), sort_keys=True) == json.dumps(arguments, sort_keys=True)
    except (TypeError, ValueError):
        return False


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
