"""Gemma 4's tool calls, streamed as the JSON mlx-lm's ``gemma4`` parser makes of them.

Gemma 4 writes a call between ``<|tool_call>`` and ``<tool_call|>`` as
``call:NAME{key:<|"|>text<|"|>,count:3,nested:{flag:true}}``: JSON with bare
keys and ``<|"|>`` for a string's quotes. The parser turns the strings into
JSON strings and quotes each bare word followed by ``:`` right after ``{`` or
``,`` (``(?<=[{,])(\\w+):``), then reads JSON. :class:`Gemma4CallScanner`
does the same as the text comes: a string's text streams JSON-escaped as it
is written, a word waits until what follows it says whether it is a key,
everything else passes as written, and the object ends at its matching
brace. A body in another shape (no ``call:NAME{`` first) is refused: it
comes whole when it ends.
"""

from __future__ import annotations

import json
import re

from .scanning import ScannerState, escaped, partial_suffix

QUOTE = '<|"|>'
_HEAD = re.compile(r"\s*call:([\w-]+)\{")
_HEAD_SO_FAR = re.compile(r"\s*(c(a(l(l(:[\w-]*)?)?)?)?)?")


def _word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


class Gemma4CallScanner(ScannerState):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._depth = 0
        self._in_string = False
        self._word = ""  # a bare word being read: a key if ":" follows and it came right after "{" or ","
        self._key_place = False  # the word came right after "{" or ","
        self._last = ""  # the last character written outside a string

    def feed(self, text: str) -> str:
        self._buffer += text
        if not self.streaming:
            if self.refused or self.done or not self._head():
                return ""
            out = ["{"]
        else:
            out = []
        while self.streaming and self._buffer:
            piece = self._string() if self._in_string else self._outside()
            if piece is None:
                break
            out.append(piece)
        return "".join(out)

    def _head(self) -> bool:
        match = _HEAD.match(self._buffer)
        if match is None:
            self.refused = _HEAD_SO_FAR.fullmatch(self._buffer) is None
            return False
        self.name, self._buffer = match.group(1), self._buffer[match.end():]
        self.streaming, self._depth, self._last = True, 1, "{"
        return True

    def _string(self) -> str | None:
        at = self._buffer.find(QUOTE)
        if at >= 0:
            text, self._buffer = self._buffer[:at], self._buffer[at + len(QUOTE):]
            self._in_string, self._last = False, '"'
            return escaped(text) + '"'
        held = partial_suffix(self._buffer, QUOTE)
        text, self._buffer = self._buffer[:len(self._buffer) - held], self._buffer[len(self._buffer) - held:]
        return escaped(text) if text else None

    def _outside(self) -> str | None:
        char = self._buffer[0]
        if _word_char(char):
            if not self._word:
                self._key_place = self._last in "{,"
            self._word += char
            self._buffer = self._buffer[1:]
            return ""
        if self._word:
            word, self._word = self._word, ""
            self._last = word[-1]
            if char == ":" and self._key_place:
                self._buffer, self._last = self._buffer[1:], ":"
                return json.dumps(word, ensure_ascii=False) + ":"
            return word
        if char == "<":
            if self._buffer.startswith(QUOTE):
                self._buffer, self._in_string = self._buffer[len(QUOTE):], True
                return '"'
            if QUOTE.startswith(self._buffer):
                return None  # a string's quote may be being written
        self._buffer, self._last = self._buffer[1:], char
        if char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 0:
                self.streaming, self.done = False, True
        return char
