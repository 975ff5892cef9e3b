"""Each protocol's structured-outputs field, read into one OutputFormat (or None for free text).

- OpenAI chat completions and the agents API: ``response_format``
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``,
  ``{"type": "json_object"}`` or ``{"type": "text"}``;
- the Responses API: ``text.format`` ``{"type": "json_schema", "name",
  "schema", "strict"}``, ``{"type": "json_object"}`` or ``{"type": "text"}``;
- Anthropic Messages: ``output_config.format`` ``{"type": "json_schema",
  "schema"}`` (and the beta's top-level ``output_format``, the same shape).

A bad shape is a 400 naming the field; a schema the grammar library cannot
compile is a 400 too, raised when the API compiles it (``turns.prepare``).
``strict`` is accepted either way: every constrained reply here follows its
schema exactly.
"""

from __future__ import annotations

from typing import Any

from engine.domain.output_format import OutputFormat
from engine.errors import InvalidRequestError


def openai_response_format(value: Any, field: str = "response_format") -> OutputFormat | None:
    if value is None:
        return None
    kind = _kind(value, field, ("text", "json_object", "json_schema"))
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat.any_object()
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError(f"{field}.json_schema must be an object with a schema", field=f"{field}.json_schema")
    return _schema_format(spec.get("schema"), f"{field}.json_schema.schema", spec.get("name"))


def responses_text_format(text: Any, field: str = "text") -> OutputFormat | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError(f"{field} must be an object", field=field)
    value = text.get("format")
    if value is None:
        return None
    kind = _kind(value, f"{field}.format", ("text", "json_object", "json_schema"))
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat.any_object()
    return _schema_format(value.get("schema"), f"{field}.format.schema", value.get("name"))


def anthropic_output_format(output_config: Any, output_format: Any) -> OutputFormat | None:
    """``output_config.format`` (or the beta's ``output_format``; both given: they must agree)."""
    configured = None
    if output_config is not None:
        if not isinstance(output_config, dict):
            raise InvalidRequestError("output_config must be an object", field="output_config")
        configured = output_config.get("format")
    chosen = [(value, field) for value, field in ((configured, "output_config.format"), (output_format, "output_format"))
              if value is not None]
    if not chosen:
        return None
    formats = [_anthropic_format(value, field) for value, field in chosen]
    if len(formats) == 2 and formats[0] != formats[1]:
        raise InvalidRequestError("output_config.format and output_format differ: send one of them",
                                  field="output_format")
    return formats[0]


def _anthropic_format(value: Any, field: str) -> OutputFormat:
    _kind(value, field, ("json_schema",))
    return _schema_format(value.get("schema"), f"{field}.schema", None)


def _kind(value: Any, field: str, kinds: tuple[str, ...]) -> str:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field} must be an object with a type ({', '.join(kinds)})", field=field)
    kind = value.get("type")
    if kind not in kinds:
        raise InvalidRequestError(f"{field}.type must be one of {', '.join(kinds)}; got {kind!r}", field=f"{field}.type")
    return str(kind)


def _schema_format(schema: Any, field: str, name: Any) -> OutputFormat:
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{field} must be a JSON schema object", field=field)
    return OutputFormat.from_schema(schema, name if isinstance(name, str) else None)
