"""What a reply offered tools is constrained to: strict tools, a forced tool_choice, a response format beside tools.

A turn with tools is constrained (``engine/formats/tools/grammar.py``) when

- a tool is strict (Anthropic's and Chat Completions' ``strict: true``; the
  Responses API's function tools are strict unless they say ``false``): its
  calls' arguments follow its schema;
- ``tool_choice`` is ``any`` / ``required`` or names a tool: the reply opens
  with a call (of that tool);
- a response format is asked for as well: the reply is that JSON or calls.

Otherwise the reply is free. Only tool-call formats whose body is
JSON can be constrained (this project's Hermes fallback, which SmolLM2 and the
base models use, and mlx-lm's ``json_tools``); under any other format the
strictness is logged, once per format, and not enforced.
"""

from __future__ import annotations

import logging
from typing import Sequence

from engine.domain.chat import Conversation
from engine.domain.output_format import OutputFormat
from engine.errors import InvalidRequestError
from engine.grammar.output_grammars import OutputGrammars, check_format

from .calls import ToolFormat
from .grammar import tool_call_grammar

log = logging.getLogger(__name__)
_warned: set[str] = set()  # tool-call formats already logged as not constrainable


def reply_format(conversation: Conversation, output_format: OutputFormat | None, tool_format: ToolFormat,
                 endings: Sequence[str] = ()) -> OutputFormat | None:
    """The format the turn's reply is constrained to, or None for free text.

    ``endings``: text that ends a turn after its calls (the plain transcript's speaker markers, the request's
    stop strings); a grammar must let the model write them, or a base model could only call again.
    """
    tools, choice = conversation.tools, conversation.tool_choice
    if not tools or choice == "none":
        return output_format
    forced = choice != "auto"
    if not (forced or output_format is not None or any(tool.strict for tool in tools)):
        return output_format
    if not tool_format.json_body:
        if tool_format.start not in _warned:
            _warned.add(tool_format.start)
            log.warning("strict tools and a forced tool_choice are not enforced for the tool-call format %r "
                        "(only JSON calls can be constrained)", tool_format.start)
        return output_format
    if choice not in ("auto", "any"):
        tools = tuple(tool for tool in tools if tool.name == choice) or tools
    grammar = tool_call_grammar(tools, tool_format.start, tool_format.end, forced=forced, answer=output_format,
                                endings=tuple(dict.fromkeys(text for text in endings if text)),
                                parallel=conversation.parallel_tool_calls)
    return OutputFormat.from_lark(grammar, "tools")


def compile_reply_format(grammars: OutputGrammars, fmt: OutputFormat, conversation: Conversation,
                         asked: OutputFormat | None, field: str) -> None:
    """Compile ``fmt`` (in an API worker thread). A 400 names what cannot be used: the response format the
    client ``asked`` for (its ``field``), else the strict tool whose schema it is."""
    try:
        grammars.prepare(fmt, field if not fmt.lark else "tools")
    except InvalidRequestError:
        if not fmt.lark:
            raise
        if asked is not None:  # which part? (checked only now, a few ms each)
            check_format(asked, field)
        for index, tool in enumerate(conversation.tools):
            if tool.strict and tool.parameters:
                check_format(OutputFormat.from_schema(tool.parameters, tool.name), f"tools[{index}]")
        raise
