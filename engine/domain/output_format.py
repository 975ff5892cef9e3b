"""What a reply must be, when a client constrains it: JSON that validates against a schema.

Clients name it in their own protocol's field (OpenAI ``response_format`` and
Responses ``text.format``, Anthropic ``output_config.format``, the agents
API's ``response_format``); the API translates each into one
:class:`OutputFormat`, and the engine constrains the turn's tokens to it
(``engine/grammar``). A format is identified by its schema's compact JSON
text; the order of its keys is kept, since properties are written in it.
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

    @classmethod
    def from_schema(cls, schema: dict[str, Any], name: str | None = None) -> "OutputFormat":
        return cls(json.dumps(schema, separators=(",", ":"), ensure_ascii=False), name)

    @classmethod
    def any_object(cls) -> "OutputFormat":
        return cls.from_schema(ANY_OBJECT, "json_object")

    @property
    def schema(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.schema_json)
        return loaded

    @property
    def key(self) -> str:
        """A short digest of the schema: what compiled grammars are cached under."""
        return hashlib.sha256(self.schema_json.encode()).hexdigest()[:24]
