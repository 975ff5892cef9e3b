"""The grammar of a reply that may (or must) call tools: strict tools' arguments follow their schemas.

A model writes a tool call as text in its tool-call format; for the formats
whose body is JSON (this project's Hermes fallback and mlx-lm's
``json_tools``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``)
the reply is, in llguidance's Lark dialect::

    start: plain | calls                     (tool_choice auto)
    start: first more* ending?               (tool_choice any or a tool's name: calls only; no more*
                                             with parallel calls turned off)
    plain: text that never writes the start marker
    calls: text up to the start marker, then a call, more calls, an ending
    call:  %json {"name": <a tool's name>, "arguments": <that tool's schema>}

A strict tool's arguments follow its schema; another tool's are any JSON
object. With a response format as well (Anthropic ``output_config.format``
beside tools), the reply is that JSON or calls, never free text. After the
last call the model may end the turn (an end-of-sequence token) or write one
of ``endings``: the stop strings that end a turn in the plain transcript
format (``\\n\\nUser:``), so a base model is never forced into call after call.
The JSON style is the response formats' (``output_grammars.JSON_STYLE``).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from engine.domain.chat import ToolSpec
from engine.domain.output_format import OutputFormat
from engine.grammar.output_grammars import JSON_STYLE

# Between two calls: a newline or two (Qwen's templates write one; the fallback prompt shows none).
BETWEEN_CALLS = r"/\n{0,2}/"


def tool_call_grammar(tools: Sequence[ToolSpec], start: str, end: str, *, forced: bool,
                      answer: OutputFormat | None = None, endings: Sequence[str] = (), parallel: bool = True) -> str:
    """The Lark grammar of a reply to ``tools`` written between ``start`` and ``end`` markers.

    ``forced``: the reply must open with a call (``tool_choice`` any, or a tool's name, with ``tools``
    narrowed to it). ``answer``: a response format the reply follows when it calls nothing. ``parallel``
    False: one call at most.
    """
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    begin, finish = _literal(start), _literal(end)
    rules = [
        f"call_body: \"\\n\" call \"\\n\" {finish}",
        f"more: SEP {begin} call_body",
        f"SEP: {BETWEEN_CALLS}",
        f"call: %json {_json(_call_schema(tools))}",
        f"first: {begin} call_body",
    ]
    tail = (" more*" if parallel else "") + (" ending?" if endings else "")
    if endings:
        rules.append("ending: " + " | ".join(_literal(text) for text in endings))
    if forced:
        rules.insert(0, f"start: first{tail}")
    elif answer is not None:
        rules.insert(0, f"start: answer | first{tail}")
        rules.append(f"answer: %json {_json(_with_style(answer.schema))}")
    else:
        rules.insert(0, "start: plain | calls")
        rules += [
            "plain: PLAIN",
            f"PLAIN: /(.|\\n)*/ & ~/(.|\\n)*{_regex_literal(start)}(.|\\n)*/",
            f"calls: prefix call_body{tail}",
            f"prefix[stop={_literal(start)}]: /(.|\\n)*/",
        ]
    return "\n".join(rules) + "\n"


def _call_schema(tools: Sequence[ToolSpec]) -> dict[str, Any]:
    """One call: ``{"name": ..., "arguments": ...}``, name first (as the prompt shows it), a schema per tool."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": tool.name},
                       "arguments": tool.parameters if tool.strict and tool.parameters else {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for tool in tools]
    return _with_style(options[0] if len(options) == 1 else {"anyOf": options})


def _with_style(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": JSON_STYLE}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark ``/regex/``: letters and digits as they are, anything else as a
    hex escape (so neither the regex's metacharacters nor Lark's ``/`` delimiter can mean anything)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)
