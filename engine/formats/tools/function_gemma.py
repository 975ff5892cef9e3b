"""FunctionGemma's tool calls, streamed as the JSON object mlx-lm's ``function_gemma`` parser makes of them.

FunctionGemma writes a call between ``<start_function_call>`` and
``<end_function_call>`` as ``call:NAME{key:<escape>text<escape>,count:3}``.
The parser takes the text from ``call:NAME{`` to the first ``}`` after it
and reads it from the left: a key up to its ``:``, then a string between
``<escape>`` marks (the one character after the closing mark is skipped), or
else a value up to the next ``,`` read as JSON, or kept as the text.
:class:`FunctionGemmaCallScanner` reads the same way as the text comes: a
string's text streams (JSON-escaped) as it is written, any other value once
its ``,`` or the ``}`` says where it ends, and ``}`` at that ``}``. Nothing
of a string can hold a ``}`` (the parser's arguments end there, and the call
does not parse), so a string that meets one refuses the call, which then
ends incomplete, as the parser fails it. A body in another shape (no
``call:NAME{`` first, text without a ``:`` for a key) is refused before
anything streams: it comes whole when it ends. The parser reads
one call a body.
"""

from __future__ import annotations

import json
from typing import Any

import regex

from .scanning import CheckedCallScanner, escaped, partial_suffix

ESCAPE = "<escape>"
_HEAD = regex.compile(r"\s*call:(\w+)\{")  # the parser's own pattern, after the whitespace its search skips


class FunctionGemmaCallScanner(CheckedCallScanner):
    STEPS = {"head": "_head", "key": "_key_text", "value": "_value_start", "string": "_string_text",
             "after": "_after_string", "plain": "_plain_value"}

    def __init__(self, tools: Any = None) -> None:
        from mlx_lm.tool_parsers import function_gemma  # (the parser whose reading this follows)

        super().__init__(tools)
        self._parser = function_gemma

    def _head(self) -> str | None:
        match = self._head_match(_HEAD)
        if match is None:
            return None
        self.name, self._buffer, self._state = match.group(1), self._buffer[match.end():], "key"
        return ""

    def _key_text(self) -> str | None:
        """A key: the text up to its ``:``; the ``}`` instead ends the arguments, if nothing is left before it."""
        colon, close = self._buffer.find(":"), self._buffer.find("}")
        if close >= 0 and (colon < 0 or close < colon):
            if close > 0:
                self.refused = True  # text with no ":" for a key: the parser fails the call
                return None
            self._buffer = self._buffer[1:]
            return self._finish(("" if self.streaming else "{") + "}")
        if colon < 0:
            return None
        self._key, self._buffer, self._state = self._buffer[:colon], self._buffer[colon + 1:], "value"
        if self.streaming:
            return ""
        self.streaming = True
        return "{"

    def _value_start(self) -> str | None:
        close = self._buffer.find("}")
        text = self._buffer if close < 0 else self._buffer[:close]
        if text.startswith(ESCAPE):
            self._buffer, self._opened, self._state = self._buffer[len(ESCAPE):], False, "string"
            return self._open_string()
        if close < 0 and ESCAPE.startswith(text):
            return None  # may be a string's mark
        self._value, self._state = "", "plain"
        return ""

    def _string_text(self) -> str | None:
        end, close = self._buffer.find(ESCAPE), self._buffer.find("}")
        if close >= 0 and (end < 0 or close < end):
            self.refused = True  # the arguments end inside the string: the parser fails the call
            return None
        if end >= 0:
            text, self._buffer, self._state = self._buffer[:end], self._buffer[end + len(ESCAPE):], "after"
            return escaped(text) + '"'
        sure = len(self._buffer) - partial_suffix(self._buffer, ESCAPE)
        text, self._buffer = self._buffer[:sure], self._buffer[sure:]
        return escaped(text) or None

    def _after_string(self) -> str | None:
        """The parser skips the one character after a string's closing mark (a ``,``), unless the arguments end."""
        if not self._buffer:
            return None
        if self._buffer[0] == "}":
            self._buffer = self._buffer[1:]
            return self._finish("}")
        self._buffer, self._state = self._buffer[1:], "key"
        return ""

    def _plain_value(self) -> str | None:
        ends = [at for at in (self._buffer.find(","), self._buffer.find("}")) if at >= 0]
        if not ends:
            return None
        end = min(ends)
        text, closes, self._buffer = self._buffer[:end], self._buffer[end] == "}", self._buffer[end + 1:]
        try:
            value: Any = json.loads(text)
        except json.JSONDecodeError:
            value = text
        member = self._member(self._key, value)
        if self.refused or not closes:
            self._state = "key"
            return member
        return self._finish(member + "}")

    def _finish(self, closing: str) -> str:
        return self._checked(closing, lambda: self._parser.parse_tool_call(self._written))
