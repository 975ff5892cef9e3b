"""What a reply must be, when a client constrains it: JSON that validates against a schema, or a grammar.

Clients name it in their own protocol's field (OpenAI ``response_format`` and
Responses ``text.format``, Anthropic ``output_config.format``, the agents
API's ``response_format``); the API translates each into one
:class:`OutputFormat`, and the engine constrains the turn's tokens to it
(``engine/grammar``). A format is identified by its schema's compact JSON
text; the order of its keys is kept, since properties are written in it.

Strict tools (and a forced ``tool_choice``) constrain a reply too, to text
or tool calls in the model's tool-call format: that is a grammar, written by
``engine/formats/tools/grammar.py`` in llguidance's Lark dialect and carried
here as its text (``lark``), identified the same way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

# ``{"type": "json_object"}``: any JSON object (OpenAI's JSON mode).
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class OutputFormat:
    schema_json: str  # the schema as compact JSON text: its identity (key order kept: properties come out in it)
    name: str | None = None  # the client's name for it (OpenAI's json_schema.name), for messages
    lark: str = ""  # instead of a schema: a grammar in llguidance's Lark dialect (tool calls; see engine/formats/tools/grammar.py)

    @classmethod
    def from_schema(cls, schema: dict[str, Any], name: str | None = None) -> "OutputFormat":
        return cls(json.dumps(schema, separators=(",", ":"), ensure_ascii=False), name)

    @classmethod
    def any_object(cls) -> "OutputFormat":
        return cls.from_schema(ANY_OBJECT, "json_object")

    @classmethod
    def from_lark(cls, grammar: str, name: str | None = None) -> "OutputFormat":
        return cls("", name, grammar)

    @property
    def schema(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.schema_json)
        return loaded

    @property
    def key(self) -> str:
        """A short digest of the schema (or grammar): what compiled grammars are cached under."""
        identity = f"lark:{self.lark}" if self.lark else self.schema_json
        return hashlib.sha256(identity.encode()).hexdigest()[:24]
