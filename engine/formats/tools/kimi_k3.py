"""Kimi K3's tool calls, streamed as the JSON object mlx-lm's ``kimi_k3`` parser makes of them.

Kimi K3 writes its calls inside a tools section (the markers), in XTML::

    <|open|>call tool="NAME" index="1"<|sep|>
      <|open|>argument key="KEY" type="string"<|sep|>VALUE<|close|>argument<|sep|>
    <|close|>call<|sep|>

or with the arguments as one JSON object,
``<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>``. The parser
keeps a ``string`` argument (the default type) as written and reads any
other as JSON, else as the text; a JSON block anywhere in the call wins over
its arguments. :class:`KimiK3CallScanner` writes that object as it goes: a
string argument's key and text (JSON-escaped) as it is written, any other
once it closes (through the parser's own reading), a JSON block's object as
written, and the object's end at ``<|close|>call<|sep|>``, once the parser's
reading of the whole call agrees (a JSON block written after arguments that
streamed ends the call incomplete). Held back only a possible end tag. A
call without a tool name, or an argument without a key, is refused before
anything of it streams where it can be: it comes whole when the section ends.
Only the first call of a section streams; the others come whole
when the section ends (tool_calls.py).
"""

from __future__ import annotations

from typing import Any

from .scanning import CheckedCallScanner, JsonObjectEnd, escaped, partial_suffix

CALL, SEP, CALL_END = "<|open|>call", "<|sep|>", "<|close|>call<|sep|>"
ARGUMENT, ARGUMENT_END = "<|open|>argument", "<|close|>argument<|sep|>"
JSON_BLOCK, JSON_END = "<|open|>json", "<|close|>json<|sep|>"
JSON_SPACE = " \t\n\r"


class KimiK3CallScanner(CheckedCallScanner):
    STEPS = {"call": "_call", "arguments": "_arguments", "argument": "_argument", "value": "_value_text",
             "json": "_json_head", "object": "_object", "after_object": "_after_object", "end": "_call_end"}

    def __init__(self, tools: Any = None) -> None:
        from mlx_lm.tool_parsers import kimi_k3  # (the parser whose reading this follows)

        super().__init__(tools)
        self._parser = kimi_k3
        self._attributes = ""  # the call tag's
        self._body_at = 0  # where the call's body begins in the text written
        self._type = "string"  # the open argument's
        self._object = JsonObjectEnd()
        self._object_text = ""

    def _call(self) -> str | None:
        at = self._buffer.find(CALL)
        if at < 0:
            self._buffer = self._buffer[len(self._buffer) - partial_suffix(self._buffer, CALL):]
            return None
        sep = self._buffer.find(SEP, at)
        if sep < 0:
            self._buffer = self._buffer[at:]
            return None
        self._attributes = self._buffer[at + len(CALL):sep]
        self.name = self._parser._parse_attrs(self._attributes).get("tool")
        if not self.name or "<|" in self._attributes:
            self.refused = True  # the parser skips a call without a name
            return None
        self._buffer, self._state = self._buffer[sep + len(SEP):], "arguments"
        self._body_at = len(self._written) - len(self._buffer)
        return ""

    def _next(self, *markers: str) -> tuple[int, str] | None:
        """The first of ``markers`` in the text, and where; the text before it is skipped, as by the parser."""
        found = [(at, marker) for marker in markers if (at := self._buffer.find(marker)) >= 0]
        if found:
            return min(found)
        held = max(partial_suffix(self._buffer, marker) for marker in markers)
        self._buffer = self._buffer[len(self._buffer) - held:]
        return None

    def _arguments(self) -> str | None:
        """Before an argument: the next one, the call's end, or (before any argument) its JSON block."""
        markers = (ARGUMENT, CALL_END) if self.streaming else (ARGUMENT, JSON_BLOCK, CALL_END)
        found = self._next(*markers)
        if found is None:
            return None
        at, marker = found
        self._buffer = self._buffer[at:] if marker == CALL_END else self._buffer[at + len(marker):]
        self._state = {ARGUMENT: "argument", JSON_BLOCK: "json", CALL_END: "end"}[marker]
        return ""

    def _argument(self) -> str | None:
        sep = self._buffer.find(SEP)
        if sep < 0:
            return None
        attributes = self._buffer[:sep]
        parsed = self._parser._parse_attrs(attributes)
        if "key" not in parsed or "<|" in attributes:
            self.refused = True  # the parser skips the whole call
            return None
        self._key, self._type = parsed["key"], parsed.get("type", "string")
        self._buffer, self._state, self._value, self._opened = self._buffer[sep + len(SEP):], "value", "", False
        if self.streaming:
            return ""
        self.streaming = True
        return "{"

    def _value_text(self) -> str | None:
        end, call_end = self._buffer.find(ARGUMENT_END), self._buffer.find(CALL_END)
        if call_end >= 0 and (end < 0 or call_end < end):  # the call ends inside it: the parser drops it
            if self._opened:
                self.refused = True
                return None
            self._state = "arguments"
            return ""
        if end >= 0:
            text, self._buffer, self._state = self._buffer[:end], self._buffer[end + len(ARGUMENT_END):], "arguments"
            return self._closed_value(text)
        sure = len(self._buffer) - max(partial_suffix(self._buffer, ARGUMENT_END),
                                       partial_suffix(self._buffer, CALL_END))
        text, self._buffer = self._buffer[:sure], self._buffer[sure:]
        if self._type != "string":
            self._value += text
            return None
        return self._open_string() + escaped(text) if text else None

    def _closed_value(self, text: str) -> str:
        key, self._key = self._key, None
        if self._opened:
            return escaped(text) + '"'
        return self._member(key, self._parser._decode_value(self._value + text, self._type))

    def _json_head(self) -> str | None:
        sep = self._buffer.find(SEP)
        if sep < 0:
            return None
        if "<|" in self._buffer[:sep]:
            self.refused = True
            return None
        self._buffer, self._state = self._buffer[sep + len(SEP):].lstrip(JSON_SPACE), "object"
        return ""

    def _object(self) -> str | None:
        """The JSON block's object, as written, to its matching brace; the block may not end inside it."""
        if not self.streaming:
            self._buffer = self._buffer.lstrip(JSON_SPACE)
            if not self._buffer:
                return None
            if self._buffer[0] != "{":
                self.refused = True  # not an object: the parser skips the call
                return None
            self.streaming = True
        piece = self._object.take(self._buffer)
        self._buffer, self._object_text = self._buffer[len(piece):], self._object_text + piece
        recent = self._object_text[-(len(piece) + len(CALL_END)):]
        if JSON_END in recent or CALL_END in recent:
            self.refused = True  # the block or the call ends inside the object: the parser skips the call
            return None
        if self._object.closed:
            self._state = "after_object"
        return piece or None

    def _after_object(self) -> str | None:
        """Only whitespace between the object and the block's end (json.loads reads nothing else)."""
        end = self._buffer.find(JSON_END)
        text = self._buffer[:end] if end >= 0 else self._buffer[:len(self._buffer) - partial_suffix(self._buffer,
                                                                                                    JSON_END)]
        if text.strip(JSON_SPACE):
            self.refused = True
            return None
        if end < 0:
            self._buffer = self._buffer[len(text):]
            return None
        self._buffer, self._state = self._buffer[end + len(JSON_END):], "end"
        return ""

    def _call_end(self) -> str | None:
        """The call's end: the object closes, if the parser reads the call as it streamed."""
        at = self._next(CALL_END)
        if at is None:
            return None
        body = self._written[self._body_at:len(self._written) - len(self._buffer) + at[0]]
        closing = "" if self._object.closed else ("}" if self.streaming else "{}")
        self.streaming = True
        return self._checked(closing, lambda: self._parser._parse_single_call(self._attributes, body))
