"""MiniCPM5's tool calls, streamed as the JSON object mlx-lm's ``minicpm5`` parser makes of them.

MiniCPM5 writes each call as its own ``<function name="NAME">`` ...
``</function>`` block (those are the markers), its parameters as
``<param name="KEY">VALUE</param>``, a value holding ``<``, ``&`` or a
newline wrapped in ``<![CDATA[...]]>``. The parser takes a CDATA block's text
as written and strips any other value, then converts it by the types the
tool's schema gives the parameter, as MiniMax's does (a parameter it does not
describe is a string; ``null`` is None whatever the type).
:class:`MiniCpm5CallScanner` writes that object as it goes: ``{`` once the
name is known, a parameter that can only be a string (its key and text,
JSON-escaped) as it is written, any other once its ``</param>`` comes
(through the parser's own reading), and ``}`` when the call's body ends.
Held back only what may still change: a possible end tag or CDATA end,
trailing whitespace outside CDATA, and a value that may yet be exactly
``null``. A body whose name is not in the parser's shape is refused before
anything streams: it comes whole when it ends.
"""

from __future__ import annotations

from typing import Any

import regex

from .scanning import TaggedValueScanner, partial_suffix

PARAMETER, PARAMETER_END, CDATA_END = "<param", "</param>", "]]>"
_NAME = r"(?P<name>\"[^\"]*\"|'[^']*'|[^\s\"'<>]+)"
# The parser's own patterns: the call's head (after the whitespace its search skips) and a parameter's tag.
_HEAD = regex.compile(r"\s*(?:<function\s+)?(?:name\s*=\s*)?" + _NAME + r"\s*>", regex.DOTALL)
_PARAMETER_HEAD = regex.compile(r"<param\s+name\s*=\s*" + _NAME + r"\s*>", regex.DOTALL)
_CDATA_START = regex.compile(r"\s*<!\[CDATA\[", regex.DOTALL)
_CDATA_TAIL = regex.compile(r"\]\]>\s*$")  # where the parser's CDATA text ends, if the value ends here
STRING_TYPES = {"string", "str", "text"}


class MiniCpm5CallScanner(TaggedValueScanner):
    STEPS = {"head": "_head", "parameters": "_parameters", "value": "_value_text"}
    VALUE_END = PARAMETER_END

    def __init__(self, tools: Any = None) -> None:
        from mlx_lm.tool_parsers import (  # (the parser whose reading this follows, and its helpers)
            minicpm5,
            minimax_m2,
        )

        super().__init__(tools)
        self._parser, self._helpers = minicpm5, minimax_m2
        self._config: dict[str, Any] = {}

    def _read_call(self) -> Any:
        return self._parser.parse_tool_call(self._written, self._tools)

    def _head(self) -> str | None:
        match = self._head_match(_HEAD)
        if match is None:
            return None
        self.name = self._helpers._extract_name(match.group("name"))
        self._buffer, self._config = self._buffer[match.end():], self._parameters_of(self.name)
        self.streaming, self._state = True, "parameters"
        return "{"

    def _parameters(self) -> str | None:
        """The next ``<param name=...>`` tag; a ``<param`` that is not one is text the parser skips."""
        at = self._buffer.find(PARAMETER)
        if at < 0:
            self._buffer = self._buffer[len(self._buffer) - partial_suffix(self._buffer, PARAMETER):]
            return None
        match = _PARAMETER_HEAD.match(self._buffer, at, partial=True)
        if match is None:
            self._buffer = self._buffer[at + 1:]
            return ""
        if match.partial:
            self._buffer = self._buffer[at:]
            return None
        return self._begin_value(self._helpers._extract_name(match.group("name")), self._buffer[match.end():])

    def _sure_text(self) -> str | None:
        """The open value's text that will be its string whatever comes next, or None (not surely a string)."""
        types = self._helpers._get_param_types_from_config(self._key, self._config)
        if not {t.lower() for t in types} <= STRING_TYPES:
            return None
        cdata = _CDATA_START.match(self._value, partial=True)
        if cdata is not None and cdata.partial:
            return None  # may open a CDATA block
        if cdata is not None:
            content = self._value[cdata.end():]
            tail = _CDATA_TAIL.search(content)
            text = content[:tail.start()] if tail else content[:len(content) - partial_suffix(content, CDATA_END)]
        else:
            text = self._value.strip()
        if not self._opened and "null".startswith(text.lower()):
            return None  # may yet be exactly "null" (None)
        return text

    def _read_value(self, key: str | None) -> Any:
        """Stripped (CDATA as written), then converted by the schema's types; a CDATA block that did not end
        as one is read as the whole text, which differs from what streamed (the call ends incomplete)."""
        types = self._helpers._get_param_types_from_config(key, self._config)
        return self._helpers._convert_param_value_with_types(self._parser._param_value(self._value), types)

    def _parameters_of(self, name: str) -> dict[str, Any]:
        """The tool's parameters' schemas by name, as the parser reads them from the request's tools."""
        found: dict[str, Any] = {}
        for tool in self._tools or ():
            function = tool.get("function", False) if isinstance(tool, dict) else None
            if function and function.get("name") == name and function.get("parameters", False):
                found = function["parameters"].get("properties", {})
        return found
