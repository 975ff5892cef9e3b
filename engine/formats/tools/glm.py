"""GLM-4.5/4.7's tool calls, streamed as the JSON object mlx-lm's ``glm47`` parser makes of them.

GLM writes a call between ``<tool_call>`` markers as the tool's name, then
each argument as a key and a value::

    NAME<arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...

The parser strips the name, keys and values; keeps a value as text when the
tool's schema says the parameter is a string; and reads any other value as
JSON, else as a Python literal, else as the text. :class:`GlmCallScanner`
writes that object as it goes: ``{`` once the name is known, a string
parameter's key and text (JSON-escaped) as it is written, any other
parameter once its value closes (through the parser's own reading), and
``}`` when the call's body ends. Held back only what may still change: a
possible end tag and trailing whitespace (which the parser strips).

A body in another shape (GLM's JSON or ``name key=value`` fallbacks) never
finds an ``<arg_key>``: it never starts streaming, and the call comes whole
when it ends.

LongCat writes the same shape with ``<longcat_arg_key>`` tags (mlx-lm's
``longcat`` parser, which asks the schema argument by argument):
:class:`LongcatCallScanner`.
"""

from __future__ import annotations

from typing import Any

from .scanning import TaggedCallScanner, escaped, partial_suffix


class GlmCallScanner(TaggedCallScanner):
    STEPS = {"name": "_name", "key": "_key_text", "between": "_between", "value": "_value_text",
             "arguments": "_arguments"}
    TAG = "arg"  # the tags' stem: <arg_key>, </arg_key>, <arg_value>, </arg_value>

    def __init__(self, tools: Any = None) -> None:
        from mlx_lm.tool_parsers import glm47  # (the parser whose reading this follows)

        super().__init__(tools)
        self._parser: Any = glm47
        self._strings: set[str] = set()
        self._key_open, self._key_close = f"<{self.TAG}_key>", f"</{self.TAG}_key>"
        self._value_open, self._value_close = f"<{self.TAG}_value>", f"</{self.TAG}_value>"

    def close(self) -> str:
        """The call's body ended (its ``</tool_call>``): the object closes, unless a value was left open (the
        parser drops that argument, which has partly streamed: the call ends incomplete)."""
        if not self.streaming:
            return ""
        self.streaming = False
        if self._state == "value" and self._opened:
            self.refused = True
            return ""
        self.done = True
        return "}"

    def _is_string(self, key: str | None) -> bool:
        """Whether the parser keeps this argument's value as the text written (the tool's schema says string)."""
        return key in self._strings

    def _string_arguments(self, name: str) -> set[str]:
        return self._parser._get_string_arg_names(name, self._tools)

    def _name(self) -> str | None:
        at = self._buffer.find(self._key_open)
        if at < 0:
            return None
        self.name, self._buffer = self._buffer[:at].strip(), self._buffer[at + len(self._key_open):]
        self._strings = self._string_arguments(self.name)
        self.streaming, self._state = True, "key"
        return "{"

    def _key_text(self) -> str | None:
        at = self._buffer.find(self._key_close)
        if at < 0:
            return None
        self._key, self._buffer = self._buffer[:at].strip(), self._buffer[at + len(self._key_close):]
        self._state = "between"
        return ""

    def _between(self) -> str | None:
        """After a key, only whitespace (or a written ``\\n``) before its value, as the parser's pattern allows."""
        text = self._buffer
        while text[:1].isspace() or text.startswith("\\n"):
            text = text[2:] if text.startswith("\\n") else text[1:]
        self._buffer = text
        if text.startswith(self._value_open):
            self._buffer, self._value, self._opened = text[len(self._value_open):], "", False
            self._state = "value"
            return ""
        if not text or self._value_open.startswith(text) or text == "\\":
            return None
        self.refused = True  # the parser skips such a key; what streamed cannot be taken back
        return None

    def _value_text(self) -> str | None:
        end = self._buffer.find(self._value_close)
        if end >= 0:
            self._value += self._buffer[:end]
            self._buffer, self._state = self._buffer[end + len(self._value_close):], "arguments"
            return self._closed_value()
        held = partial_suffix(self._buffer, self._value_close)
        self._value += self._buffer[:len(self._buffer) - held]
        self._buffer = self._buffer[len(self._buffer) - held:]
        if not self._is_string(self._key):
            return None  # read whole when it closes
        return self._stripped_text()

    def _closed_value(self) -> str:
        key = self._key
        if self._is_string(key):  # the rest of its text, stripped as the parser strips it
            rest = self._value.rstrip() if self._opened else self._value.strip()
            text = self._open_string() + escaped(rest) + '"'
            self._key = None
            return text
        self._key = None
        return self._member(key, self._parser._deserialize(self._value.strip()))

    def _arguments(self) -> str | None:
        """Between two arguments: the parser looks for the next key's tag and skips anything else."""
        at = self._buffer.find(self._key_open)
        if at < 0:
            self._buffer = self._buffer[len(self._buffer) - partial_suffix(self._buffer, self._key_open):]
            return None
        self._buffer, self._state = self._buffer[at + len(self._key_open):], "key"
        return ""


class LongcatCallScanner(GlmCallScanner):
    """LongCat's calls: GLM's shape with ``<longcat_arg_key>`` tags; a value is text when the tool's schema types
    that argument a string (asked argument by argument), else read as JSON, a Python literal, or the text."""

    TAG = "longcat_arg"

    def __init__(self, tools: Any = None) -> None:
        from mlx_lm.tool_parsers import longcat  # (the parser whose reading this follows)

        super().__init__(tools)
        self._parser = longcat

    def _string_arguments(self, name: str) -> set[str]:
        return set()  # asked argument by argument (_is_string)

    def _is_string(self, key: str | None) -> bool:
        return self.name is not None and key is not None and self._parser._is_string_type(self.name, key,
                                                                                              self._tools)
