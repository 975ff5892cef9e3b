"""Tool calls whose arguments are one JSON object after a header that names the tool.

Mistral writes ``NAME[ARGS]{...}`` after ``[TOOL_CALLS]`` (no end marker: the
call runs to the end of the reply); Kimi K2 writes
``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>``
inside its tool-calls section. mlx-lm's parsers (``mistral``, ``kimi_k2``) read
the name from the header and the arguments as the JSON after it.
:class:`HeadedJsonScanner` holds the text back until its header is whole, then
hands out the object's own text as written, from ``{`` to its matching ``}``;
concatenated, the pieces parse to what the parser reads. A body in another
shape (Mistral's JSON list of calls, arguments that are not an object, text
before the name) is refused: that call comes whole when it ends.
Only the first call of a body streams; the others come whole when the
body ends (tool_calls.py).
"""

from __future__ import annotations

import re
from typing import Callable

from .scanning import JsonObjectEnd, ScannerState

# (buffer) -> (name, header length) once the header is whole; None while it may still become one; raises
# NotAHeader when it cannot.
HeaderReader = Callable[[str], "tuple[str, int] | None"]


class NotAHeader(ValueError):
    pass


_MISTRAL_NAME = re.compile(r"\s*([\w-]+)\s*")
_MISTRAL_ARGS = "[ARGS]"


def mistral_header(buffer: str) -> tuple[str, int] | None:
    """``NAME[ARGS]`` (mlx-lm's ``mistral`` header: a name of word characters and dashes)."""
    match = _MISTRAL_NAME.match(buffer)
    if match is None:
        if buffer.strip():
            raise NotAHeader(buffer[:40])
        return None
    rest = buffer[match.end():]
    if rest.startswith(_MISTRAL_ARGS):
        return match.group(1), match.end() + len(_MISTRAL_ARGS)
    if _MISTRAL_ARGS.startswith(rest):
        return None  # the name or its [ARGS] is still being written
    raise NotAHeader(buffer[:40])


_KIMI_CALL, _KIMI_ARGUMENTS, _KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_KIMI_ID = re.compile(r"\s*(?:functions\.)?(.+?):\d+\s*", re.DOTALL)  # kimi_k2's _func_name_regex, without its end


def kimi_header(buffer: str) -> tuple[str, int] | None:
    """``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>`` (the call marker may be left out, as
    mlx-lm's ``kimi_k2`` parser allows)."""
    text = buffer.lstrip()
    skipped = len(buffer) - len(text)
    if not text or (_KIMI_CALL.startswith(text) and text != _KIMI_CALL):
        return None
    if text.startswith(_KIMI_CALL):
        text, skipped = text[len(_KIMI_CALL):], skipped + len(_KIMI_CALL)
    at = text.find(_KIMI_ARGUMENTS)
    if at < 0:
        if _KIMI_END in text:
            raise NotAHeader(buffer[:40])
        return None
    match = _KIMI_ID.fullmatch(text[:at])
    if match is None:
        raise NotAHeader(buffer[:40])
    return match.group(1), skipped + at + len(_KIMI_ARGUMENTS)


class HeadedJsonScanner(ScannerState):
    """Reads a header (``read_header``) and the JSON object after it; :meth:`feed` returns the new part of the
    object's text once the name is known (``name``); ``streaming`` while it is written, ``done`` once it closed,
    ``refused`` when the body turned out not to stream."""

    def __init__(self, read_header: HeaderReader) -> None:
        super().__init__()
        self._read_header = read_header
        self._head = ""  # the text before the object, while the header is read
        self._end = JsonObjectEnd()

    def feed(self, text: str) -> str:
        if self.refused or self.done:
            return ""
        if not self.streaming:
            text = self._through_header(text)
            if not self.streaming:
                return ""
        out = self._end.take(text)
        if self._end.closed:
            self.streaming, self.done = False, True
        return out

    def _through_header(self, text: str) -> str:
        """Reads ``text`` into the header; once the object's ``{`` comes, the text from it on (else "")."""
        self._head += text
        if self.name is None:
            try:
                header = self._read_header(self._head)
            except NotAHeader:
                self.refused = True
                return ""
            if header is None:
                return ""
            self.name, used = header
            self._head = self._head[used:]
        rest = self._head.lstrip()
        if not rest:
            self._head = ""
            return ""
        if rest[0] != "{":
            self.refused = True  # arguments that are not an object: parsed whole when the call ends
            return ""
        self._head, self.streaming = "", True
        return rest
