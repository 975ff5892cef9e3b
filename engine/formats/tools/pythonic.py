"""LFM2's tool calls, streamed as the JSON object mlx-lm's ``pythonic`` parser makes of them.

LFM2 writes its calls between ``<|tool_call_start|>`` and ``<|tool_call_end|>``
as a Python list of calls, ``[name(a="x", b=1), other(c=[1, 2])]``. The
parser reads that text as Python (keyword arguments only, each a literal, with
JSON's ``true``/``false``/``null`` read as Python's), and falls back to a
regex when the whole is not such Python. :class:`PythonicCallScanner` reads
the first call as Python as it comes: a string argument's key and text
(decoded as Python decodes it, JSON-escaped) as it is written, implicit
concatenation included, any other argument once the ``,`` or ``)`` after it
says where it ends (through the parser's own literal reading), and ``}`` at
the call's ``)``. Held back only an escape or a string end still being
written. Since the fallback hangs on the whole text, the object counts as
done only when the call's body ends and the parser's Python reading of it
agrees (else the call ends incomplete). A body in another shape (not
``[name(`` first, a positional argument, ``**kwargs``) is refused before
anything streams: it comes whole when it ends. Only the first call
of a list streams; the others come whole when the body ends (tool_calls.py).
"""

from __future__ import annotations

import ast
import keyword
import unicodedata
from typing import Any

import regex

from .scanning import CheckedCallScanner, escaped

SPACE = " \t\f\r\n"  # what Python skips between the tokens of a bracketed expression
_HEAD = regex.compile(r"[ \t\f\r\n]*\[[ \t\f\r\n]*(?P<name>[^\W\d]\w*(?:\.[^\W\d]\w*)*)[ \t\f\r\n]*\(")
_KEY = regex.compile(r"(?P<key>[^\W\d]\w*)[ \t\f\r\n]*=(?P<next>[^=])")  # "a=", not "a==" (a comparison)
_STRING_PREFIXES = ("r", "R", "u", "U")  # those whose literals are str (b: bytes, f: not a literal)


def _identifier(word: str) -> str | None:
    """``word`` as Python names it (NFKC-normalised), or None if it cannot be an identifier."""
    if keyword.iskeyword(word) or not word.isidentifier():
        return None
    return unicodedata.normalize("NFKC", word)


def _opening(text: str) -> tuple[str, str] | bool | None:
    """A str literal's prefix and quote at the start of ``text``; None: not yet known; False: not one."""
    prefix = text[:1] if text[:1] in _STRING_PREFIXES else ""
    rest = text[len(prefix):]
    if not rest:
        return None
    quote = rest[0]
    if quote not in "\"'":
        return False
    if rest in (quote, quote * 2):
        return None  # an empty string or a triple-quoted one
    return prefix, quote * 3 if rest.startswith(quote * 3) else quote


class PythonicCallScanner(CheckedCallScanner):
    STEPS = {"head": "_head", "arguments": "_arguments", "value": "_value_start", "string": "_string",
             "after_string": "_after_string", "held": "_held", "rest": "_rest"}

    def __init__(self, tools: Any = None) -> None:
        from mlx_lm.tool_parsers import pythonic  # (the parser whose reading this follows)

        super().__init__(tools)
        self._parser = pythonic
        self._keys: set[str] = set()
        self._quote = ""  # the open string literal's: ', ", ''' or """
        self._raw = False
        self._depth = 0  # of brackets, in a held value
        self._in = ""  # the quote of a string inside a held value

    def close(self) -> str:
        """The body ended: the object (closed at the call's ``)``) is done if the parser reads the body as Python
        to the same first call; else its fallback read it otherwise, and the call ends incomplete."""
        if self._state != "rest":
            return ""
        return self._checked("", lambda: self._parser._parse_pythonic_tool_call(self._written))

    def _head(self) -> str | None:
        match = self._head_match(_HEAD)
        if match is None:
            return None
        parts = [_identifier(part) for part in match.group("name").split(".")]
        if None in parts:
            self.refused = True
            return None
        self.name, self._buffer, self._state = ".".join(parts), self._buffer[match.end():], "arguments"
        return ""

    def _arguments(self) -> str | None:
        """After ``(`` or an argument's ``,``: the next keyword (``key=``) or the call's ``)``."""
        self._buffer = self._buffer.lstrip(SPACE)
        if not self._buffer:
            return None
        if self._buffer[0] == ")":
            self._buffer = self._buffer[1:]
            return self._call_closes("}")
        match = _KEY.match(self._buffer, partial=True)
        key = _identifier(match.group("key")) if match is not None and not match.partial else None
        if match is not None and match.partial:
            return None
        if key is None or key in self._keys:
            self.refused = True  # a positional argument, **kwargs, a repeated keyword: not the parser's Python
            return None
        self._keys.add(key)
        self._key, self._buffer, self._state = key, self._buffer[match.start("next"):], "value"
        if self.streaming:
            return ""
        self.streaming = True
        return "{"

    def _call_closes(self, closing: str) -> str:
        self._state, self.streaming = "rest", False
        return ("" if self._members_started() else "{") + closing

    def _members_started(self) -> bool:
        return bool(self._keys)

    def _value_start(self) -> str | None:
        self._buffer = self._buffer.lstrip(SPACE)
        opening = _opening(self._buffer)
        if opening is None:
            return None
        if opening is False:
            self._value, self._depth, self._in, self._state = "", 0, "", "held"
            return ""
        self._begin_string(opening)
        self._opened = False
        return self._open_string()

    def _begin_string(self, opening: tuple[str, str]) -> None:
        prefix, self._quote = opening
        self._raw = prefix in ("r", "R")
        self._buffer, self._state = self._buffer[len(prefix) + len(self._quote):], "string"

    def _string(self) -> str | None:
        text, quote, at = self._buffer, self._quote, 0
        while at < len(text):
            if text[at] == "\\":
                length = self._escape_length(text, at)
                if length is None:
                    break
                at += length
            elif text.startswith(quote, at):
                self._buffer, self._state = text[at + len(quote):], "after_string"
                return self._decoded(text[:at])
            elif quote.startswith(text[at:]):
                break  # a triple quote's end may be being written
            elif text[at] in "\r\n" and len(quote) == 1:
                self.refused = True  # a line break in a one-line string: not Python
                return None
            else:
                at += 1
        self._buffer = text[at:]
        return self._decoded(text[:at]) or None

    def _escape_length(self, text: str, at: int) -> int | None:
        """How long the escape at ``at`` is, None if it may still be being written."""
        if at + 1 >= len(text):
            return None
        char = text[at + 1]
        if self._raw:
            return 2
        if char in "01234567":
            end = at + 1
            while end < len(text) and end < at + 4 and text[end] in "01234567":
                end += 1
            return None if end == len(text) and end < at + 4 else end - at
        width = {"x": 4, "u": 6, "U": 10}.get(char)
        if width is not None:
            return width if at + width <= len(text) else None
        if char == "N":
            close = text.find("}", at)
            return close - at + 1 if close >= 0 else None
        return 2

    def _decoded(self, source: str) -> str:
        """A piece of the open literal's text, as Python reads it (whole escapes only), JSON-escaped."""
        if not source:
            return ""
        try:
            return escaped(ast.literal_eval(("r" if self._raw else "") + self._quote + source + self._quote))
        except (SyntaxError, ValueError):
            self.refused = True  # an escape Python rejects: the parser falls back to its regex
            return ""

    def _after_string(self) -> str | None:
        """After a literal: the argument's ``,``, the call's ``)``, or another literal joined to it."""
        self._buffer = self._buffer.lstrip(SPACE)
        if not self._buffer:
            return None
        if self._buffer[0] in ",)":
            closes, self._buffer, self._state = self._buffer[0] == ")", self._buffer[1:], "arguments"
            return self._call_closes('"}') if closes else '"'
        opening = _opening(self._buffer)
        if opening is None:
            return None
        if opening is False:
            self.refused = True  # an operator or a bytes literal: not a literal the parser reads as text
            return None
        self._begin_string(opening)
        return ""

    def _held(self) -> str | None:
        """A value that is not a str literal, read whole to the ``,`` or ``)`` that ends it."""
        text, at = self._buffer, 0
        while at < len(text):
            char = text[at]
            if self._in:
                if char == "\\":
                    if at + 1 >= len(text):
                        break
                    at += 2
                elif text.startswith(self._in, at):
                    at, self._in = at + len(self._in), ""
                elif self._in.startswith(text[at:]):
                    break
                else:
                    at += 1
                continue
            if char in "\"'":
                if not text.startswith(char * 3, at) and (char * 3).startswith(text[at:]):
                    break  # "" or a triple quote's start
                self._in = char * 3 if text.startswith(char * 3, at) else char
                at += len(self._in)
                continue
            if char == "#" or (char in "]}" and self._depth == 0):
                self.refused = True  # a comment or an unmatched bracket: left to the parser
                return None
            if self._depth == 0 and char in ",)":
                return self._held_closes(text[:at], closes=char == ")", rest=text[at + 1:])
            self._depth += (char in "([{") - (char in ")]}")
            at += 1
        self._value, self._buffer = self._value + text[:at], text[at:]
        return None

    def _held_closes(self, text: str, closes: bool, rest: str) -> str | None:
        source, self._buffer = self._value + text, rest
        try:
            if not source.strip(SPACE):
                raise SyntaxError("no value")
            node = ast.parse("(" + source + ")", mode="eval").body
            value = ast.literal_eval(self._parser._JSONLiterals().visit(node))
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            self.refused = True  # not a literal: the parser falls back to its regex (or fails)
            return None
        member = self._member(self._key, value)
        if self.refused:
            return None
        if closes:
            return self._call_closes(member + "}")
        self._state = "arguments"
        return member

    def _rest(self) -> str | None:
        self._buffer = ""  # the list's other calls come whole from the parser
        return None
