"""Muse Spark's tool calls, streamed as the JSON object mlx-lm's ``muse_spark`` parser makes of them.

Muse Spark writes calls between ``<atem:function_calls>`` markers as::

    <atem:invoke name="NAME">
    <atem:parameter name="KEY">VALUE</atem:parameter>
    ...
    </atem:invoke>

The parser reads any value as JSON first, else keeps it stripped as text; a
parameter runs to its ``</atem:parameter>`` even past an ``</atem:invoke>``.
:class:`MuseSparkCallScanner` writes that object as it goes: ``{`` once the
name is known, a value that can no longer be JSON (its first character
rules JSON out, or it left the words ``true``, ``false``, ``null``, ``NaN``,
``Infinity`` behind) as text while it is written, any other once it closes
(through the parser's own reading), and ``}`` at ``</atem:invoke>``. Held
back only what may still change: a possible end tag, trailing whitespace and
a value that may yet be JSON (a number, an object, a quoted string: which it
is, the close decides). A first invoke in another shape is refused before
anything streams: it comes whole when it ends. Only the first
call of a body streams; the others come whole when the body ends
(tool_calls.py).
"""

from __future__ import annotations

from typing import Any

import regex

from .scanning import TaggedValueScanner, partial_suffix

INVOKE, PARAMETER, PARAMETER_END, INVOKE_END = "<atem:invoke", "<atem:parameter", "</atem:parameter>", "</atem:invoke>"
# The parser's own tags.
_INVOKE_HEAD = regex.compile(r"<atem:invoke\b[^>]*?\bname=\"(?P<name>[^\"]+)\">", regex.DOTALL)
_PARAMETER_HEAD = regex.compile(r"<atem:parameter\b[^>]*?\bname=\"(?P<name>[^\"]+)\"[^>]*?>", regex.DOTALL)
JSON_SPACE = " \t\n\r"  # what json.loads skips around a value (str.strip skips more)
JSON_STARTS = '{["-0123456789'
JSON_WORDS = ("true", "false", "null", "NaN", "Infinity")


class MuseSparkCallScanner(TaggedValueScanner):
    STEPS = {"invoke": "_invoke", "parameters": "_parameters", "value": "_value_text"}
    VALUE_END = PARAMETER_END

    def __init__(self, tools: Any = None) -> None:
        from mlx_lm.tool_parsers import muse_spark  # (the parser whose reading this follows)

        super().__init__(tools)
        self._parser = muse_spark

    def _read_call(self) -> Any:
        return self._parser.parse_tool_call(self._written)

    def _invoke(self) -> str | None:
        at = self._buffer.find(INVOKE)
        if at < 0:
            self._buffer = self._buffer[len(self._buffer) - partial_suffix(self._buffer, INVOKE):]
            return None
        match = _INVOKE_HEAD.match(self._buffer, at, partial=True)
        if match is None and ">" in self._buffer[at:]:
            self.refused = True  # the parser would look past this invoke for another
            return None
        if match is None or match.partial:  # (regex's partial match gives up at a \b the text has not reached)
            self._buffer = self._buffer[at:]
            return None
        self.name, self._buffer = match.group("name"), self._buffer[match.end():]
        self.streaming, self._state = True, "parameters"
        return "{"

    def _parameters(self) -> str | None:
        """The next parameter's tag or the invoke's end; text between them is skipped, as by the parser."""
        at, end = self._buffer.find(PARAMETER), self._buffer.find(INVOKE_END)
        if end >= 0 and (at < 0 or end < at):
            self._buffer = self._buffer[end + len(INVOKE_END):]
            return self._checked("}", self._read_call)
        if at < 0:
            held = max(partial_suffix(self._buffer, PARAMETER), partial_suffix(self._buffer, INVOKE_END))
            self._buffer = self._buffer[len(self._buffer) - held:]
            return None
        match = _PARAMETER_HEAD.match(self._buffer, at, partial=True)
        if match is None and ">" not in self._buffer[at:]:
            self._buffer = self._buffer[at:]  # the tag is still being written (see _invoke)
            return None
        if match is None:
            after = self._buffer[at + len(PARAMETER):at + len(PARAMETER) + 1]
            if after.isalnum() or after == "_":  # "<atem:parameters...": no tag, text to the parser too
                self._buffer = self._buffer[at + 1:]
                return ""
            self.refused = True  # a parameter's tag the parser cannot read (it spans its text all the same)
            return None
        if match.partial:
            self._buffer = self._buffer[at:]
            return None
        return self._begin_value(match.group("name"), self._buffer[match.end():])

    def _sure_text(self) -> str | None:
        """The open value, stripped, once it can no longer be JSON (else the close decides)."""
        return None if self._may_be_json() else self._value.strip()

    def _may_be_json(self) -> bool:
        """Whether the open value may still read as JSON when it closes (else the parser keeps it as text)."""
        start = self._value.lstrip(JSON_SPACE)
        if not start or start[0] in JSON_STARTS:
            return True
        word = start.rstrip()
        return any(json_word.startswith(word) for json_word in JSON_WORDS)

    def _read_value(self, key: str | None) -> Any:
        return self._parser._param_value(self._value)
