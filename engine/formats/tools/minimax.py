"""MiniMax-M2's tool calls, streamed as the JSON object mlx-lm's ``minimax_m2`` parser makes of them.

MiniMax writes a call between ``<minimax:tool_call>`` markers as::

    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    ...
    </invoke>

The parser strips each value and converts it by the types the tool's schema
gives the parameter (a parameter it does not describe is a string; ``null``
is None whatever the type). :class:`MiniMaxCallScanner` writes that object as
it goes: ``{`` once the name is known, a parameter that can only be a string
(its key and text, JSON-escaped) as it is written, any other once its value
closes (through the parser's own conversion), and ``}`` at ``</invoke>``.
Held back only what may still change: a possible end tag, trailing whitespace
(which the parser strips) and a value that may yet be exactly ``null``.
Only the first call of a body streams; the others come whole when the
body ends (tool_calls.py).
"""

from __future__ import annotations

from typing import Any

from .scanning import TaggedCallScanner, escaped, partial_suffix

INVOKE, PARAMETER, PARAMETER_END, INVOKE_END = "<invoke name=", "<parameter name=", "</parameter>", "</invoke>"
STRING_TYPES = {"string", "str", "text"}


class MiniMaxCallScanner(TaggedCallScanner):
    STEPS = {"invoke": "_invoke", "parameters": "_parameters", "value": "_value_text"}

    def __init__(self, tools: Any = None) -> None:
        from mlx_lm.tool_parsers import minimax_m2  # (the parser whose reading this follows)

        super().__init__(tools)
        self._parser = minimax_m2
        self._config: dict[str, Any] = {}

    def _tag_name(self, after: int) -> tuple[str, int] | None:
        """The quoted or bare name after a tag's ``name=`` at ``after``, up to its ``>``; and where the tag ends."""
        end = self._buffer.find(">", after)
        if end < 0:
            return None
        return self._parser._extract_name(self._buffer[after:end]), end + 1

    def _invoke(self) -> str | None:
        at = self._buffer.find(INVOKE)
        if at < 0:
            self._buffer = self._buffer[len(self._buffer) - partial_suffix(self._buffer, INVOKE):]
            return None
        named = self._tag_name(at + len(INVOKE))
        if named is None:
            return None
        self.name, end = named
        if not self.name:
            self.refused = True
            return None
        self._buffer = self._buffer[end:]
        self._config = self._parameters_of(self.name)
        self.streaming, self._state = True, "parameters"
        return "{"

    def _parameters(self) -> str | None:
        """Between parameters: the next ``<parameter name=...>`` or the call's ``</invoke>``; anything else is
        skipped, as the parser's pattern skips it."""
        at, end = self._buffer.find(PARAMETER), self._buffer.find(INVOKE_END)
        if end >= 0 and (at < 0 or end < at):
            self._buffer, self.streaming, self.done = self._buffer[end + len(INVOKE_END):], False, True
            return "}"
        if at < 0:
            held = max(partial_suffix(self._buffer, PARAMETER), partial_suffix(self._buffer, INVOKE_END))
            self._buffer = self._buffer[len(self._buffer) - held:]
            return None
        named = self._tag_name(at + len(PARAMETER))
        if named is None:
            return None
        self._key, end = named
        self._buffer, self._value, self._opened, self._state = self._buffer[end:], "", False, "value"
        return ""

    def _value_text(self) -> str | None:
        end, invoke_end = self._buffer.find(PARAMETER_END), self._buffer.find(INVOKE_END)
        if invoke_end >= 0 and (end < 0 or invoke_end < end):  # the call ends inside the value: the parser drops it
            if self._opened:
                self.refused = True  # partly streamed: the call ends incomplete
                return None
            self._state = "parameters"
            return ""
        if end >= 0:
            self._value += self._buffer[:end]
            self._buffer, self._state = self._buffer[end + len(PARAMETER_END):], "parameters"
            return self._closed_value()
        held = max(partial_suffix(self._buffer, PARAMETER_END), partial_suffix(self._buffer, INVOKE_END))
        self._value += self._buffer[:len(self._buffer) - held]
        self._buffer = self._buffer[len(self._buffer) - held:]
        if not self._only_a_string():
            return None  # converted whole when it closes
        if not self._opened and "null".startswith(self._value.strip().lower()):
            return None  # may yet be exactly "null" (None), or all whitespace so far
        return self._stripped_text()

    def _closed_value(self) -> str:
        key = self._key
        if self._opened:  # the rest of its text, stripped as the parser strips it
            text = escaped(self._value.rstrip()) + '"'
            self._key = None
            return text
        self._key = None
        types = self._parser._get_param_types_from_config(key, self._config)
        return self._member(key, self._parser._convert_param_value_with_types(self._value.strip(), types))

    def _only_a_string(self) -> bool:
        """Whether the parser keeps this parameter's value as the text written (its schema's types are only
        strings, or the tool does not describe it)."""
        types = self._parser._get_param_types_from_config(self._key, self._config)
        return {t.lower() for t in types} <= STRING_TYPES

    def _parameters_of(self, name: str) -> dict[str, Any]:
        """The tool's parameters' schemas by name, as the parser reads them from the request's tools."""
        for tool in self._tools or ():
            function = tool.get("function") if isinstance(tool, dict) else None
            if function and function.get("name") == name:
                return (function.get("parameters") or {}).get("properties", {}) or {}
        return {}
