"""Responses API items: read from a request, kept in the store, turned into a conversation.

An input item is checked and normalized once, into the shape the API itself
returns (``GET /v1/responses/{id}/input_items``), with an id when it came
without one. The normalized items are what a stored response keeps, so a
continuation (``previous_response_id``) renders exactly what the first turn
rendered and the agent's cache matches to the last token.

Decisions worth knowing:

* ``developer`` and ``system`` messages are system messages; ``instructions``
  is one more, placed first (chat templates know only ``system``).
* ``reasoning`` items are the reasoning of the assistant turn that follows
  them, given to the chat template (which decides whether it renders): their
  ``reasoning_text`` content, or what their ``encrypted_content`` carries when
  it is one of this server's (reasoning_signature.py; Codex sends reasoning
  back that way, with ``store: false``). Summaries are not the reasoning and
  are kept only to be echoed.
* A ``message`` from the assistant and the ``function_call`` items after it
  are one assistant turn with tool calls, as chat templates render them.
* Tools other than ``function`` (hosted ``web_search``, ``file_search``,
  ``custom``, ...) are skipped: a local model cannot run them, and Codex
  always sends ``web_search`` beside its function tools.
* ``input_image`` parts (data URLs; web URLs only where the server fetches
  them), in a message or a ``function_call_output``, go to a vision model as
  images, kept in the stored items so a continuation renders them again; a
  model without vision refuses them unless the server allows a placeholder.
  File and audio parts become short placeholders, as in chat completions.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Iterable, Iterator

from engine.domain.chat import ChatMessage, Conversation, Part, ToolCall, ToolSpec
from engine.errors import InvalidRequestError

from .image_inputs import from_url, image_text
from .reasoning_signature import restored, sign

Item = dict[str, Any]

_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_PLACEHOLDERS = {"input_image": "[image]", "input_file": "[file]", "input_audio": "[audio]"}
# Item types that carry no conversation a local model can use; accepted and dropped.
_DROPPED = ("web_search_call", "file_search_call", "image_generation_call", "compaction")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# -- reading a request ------------------------------------------------------------------------
def input_items(value: str | list[dict[str, Any]]) -> list[Item]:
    """The request's ``input``, checked and normalized; raises InvalidRequestError naming ``input[i]``."""
    if isinstance(value, str):
        return [_message_item({"role": "user", "content": value}, "input")]
    items: list[Item] = []
    for index, raw in enumerate(value):
        field = f"input[{index}]"
        kind = raw.get("type", "message")
        if kind == "message":
            items.append(_message_item(raw, field))
        elif kind == "function_call":
            items.append(_function_call_item(raw, field))
        elif kind == "function_call_output":
            items.append(_function_output_item(raw, field))
        elif kind == "reasoning":
            items.append(_reasoning_item(raw, field))
        elif kind in _DROPPED:
            continue
        elif kind == "item_reference":
            raise InvalidRequestError(f"{field}: item_reference is not supported; send the item itself, "
                                      "or continue with previous_response_id", field=f"{field}.type")
        else:
            raise InvalidRequestError(f"{field}.type {kind!r} is not an input item this server reads "
                                      "(message, function_call, function_call_output, reasoning)", field=f"{field}.type")
    return items


def _message_item(raw: dict[str, Any], field: str) -> Item:
    role = raw.get("role")
    if role not in _MESSAGE_ROLES:
        raise InvalidRequestError(f"{field}.role must be one of {', '.join(_MESSAGE_ROLES)}", field=f"{field}.role")
    content = raw.get("content")
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [{"type": part_type, "text": content}]
    elif isinstance(content, list):
        parts = [_part(part, f"{field}.content[{j}]") for j, part in enumerate(content)]
    else:
        raise InvalidRequestError(f"{field}.content must be a string or a list of content parts",
                                  field=f"{field}.content")
    return {"type": "message", "id": _id(raw, "msg", field), "role": role, "content": parts, "status": "completed"}


def _part(part: Any, field: str) -> dict[str, Any]:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise InvalidRequestError(f"{field} must be an object with a type", field=field)
    kind = part["type"]
    if kind in _TEXT_PARTS:
        return {"type": kind, "text": _string(part.get("text"), f"{field}.text")}
    if kind == "refusal":
        return {"type": "refusal", "refusal": _string(part.get("refusal"), f"{field}.refusal")}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{field}.image_url: an input_image needs an image_url (a data URL); file_id "
                                      "is not supported", field=f"{field}.image_url")
        from_url(url, f"{field}.image_url")  # a bad data URL is refused here, naming its field
        return {"type": kind, "image_url": url, "detail": part.get("detail") or "auto"}
    return {"type": kind}  # files, audio: a placeholder in the prompt, no payload kept


def _function_call_item(raw: dict[str, Any], field: str) -> Item:
    arguments = _string(raw.get("arguments"), f"{field}.arguments")
    parse_arguments(arguments, f"{field}.arguments")
    return {"type": "function_call", "id": _id(raw, "fc", field), "call_id": _string(raw.get("call_id"), f"{field}.call_id"),
            "name": _string(raw.get("name"), f"{field}.name"), "arguments": arguments, "status": "completed"}


def _function_output_item(raw: dict[str, Any], field: str) -> Item:
    output = raw.get("output")
    if isinstance(output, list):
        parts = [_part(part, f"{field}.output[{j}]") for j, part in enumerate(output)]
        # Kept as parts when they hold an image (read back by _parts_message); else as the text they make.
        output = parts if any(p["type"] == "input_image" for p in parts) else "\n".join(_part_text(p) for p in parts)
    if isinstance(output, list):
        return {"type": "function_call_output", "id": _id(raw, "fco", field),
                "call_id": _string(raw.get("call_id"), f"{field}.call_id"), "output": output, "status": "completed"}
    return {"type": "function_call_output", "id": _id(raw, "fco", field),
            "call_id": _string(raw.get("call_id"), f"{field}.call_id"), "output": _string(output, f"{field}.output"),
            "status": "completed"}


def _reasoning_item(raw: dict[str, Any], field: str) -> Item:
    item: Item = {"type": "reasoning", "id": _id(raw, "rs", field)}
    for key in ("summary", "content"):
        parts = raw.get(key) or []
        if not isinstance(parts, list):
            raise InvalidRequestError(f"{field}.{key} must be a list of parts", field=f"{field}.{key}")
        item[key] = [_part(part, f"{field}.{key}[{j}]") for j, part in enumerate(parts)]
    encrypted = raw.get("encrypted_content")
    if encrypted is not None:
        item["encrypted_content"] = _string(encrypted, f"{field}.encrypted_content")
    return item


def reasoning_of_item(item: Item) -> str:
    """What a reasoning item says the model reasoned: its encrypted content when it is this server's, else its
    reasoning text (summaries are not the reasoning)."""
    text = "".join(part.get("text", "") for part in item.get("content", ()))
    return restored(text, item.get("encrypted_content"))


def _id(raw: dict[str, Any], prefix: str, field: str) -> str:
    value = raw.get("id")
    if value is None:
        return new_id(prefix)
    return _string(value, f"{field}.id")


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field} must be a string", field=field)
    return value


def parse_arguments(arguments: str, field: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        raise InvalidRequestError(f"{field} is not valid JSON: {exc}", field=field) from exc
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"{field} must encode a JSON object", field=field)
    return parsed


# -- tools --------------------------------------------------------------------------------------
def function_tools(tools: list[dict[str, Any]] | None) -> tuple[ToolSpec, ...]:
    """The request's function tools (hosted tools skipped); a malformed one is a 400 naming it."""
    specs: list[ToolSpec] = []
    for index, tool in enumerate(tools or ()):
        field = f"tools[{index}]"
        if tool.get("type") != "function":
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{field}.name must be a non-empty string", field=f"{field}.name")
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise InvalidRequestError(f"{field}.description must be a string", field=f"{field}.description")
        parameters = tool.get("parameters") or {}
        _check_schema(parameters, f"{field}.parameters")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{field}.strict must be true or false", field=f"{field}.strict")
        # The Responses API's function tools are strict unless they say otherwise (Codex says false).
        specs.append(ToolSpec(name, description, parameters, strict is not False))
    return tuple(specs)


def _check_schema(schema: Any, field: str) -> None:
    """What a function's parameters must be: a JSON Schema object describing an object."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{field} must be a JSON Schema object", field=field)
    if schema.get("type", "object") != "object":
        raise InvalidRequestError(f"{field}.type must be \"object\" (a function takes named arguments)",
                                  field=f"{field}.type")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
        raise InvalidRequestError(f"{field}.properties must map names to schemas", field=f"{field}.properties")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidRequestError(f"{field}.required must be a list of property names", field=f"{field}.required")


def tool_choice(choice: str | dict[str, Any] | None, tools: tuple[ToolSpec, ...]) -> str:
    """The neutral choice: auto, none, any (``required``) or a tool's name."""
    if choice is None or choice == "auto":
        return "auto"
    if choice == "none":
        return "none"
    if not tools:
        raise InvalidRequestError("tool_choice requires function tools", field="tool_choice")
    if choice == "required":
        return "any"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if choice["name"] not in {t.name for t in tools}:
            raise InvalidRequestError(f"tool_choice names {choice['name']!r}, which is not among the tools",
                                      field="tool_choice")
        return choice["name"]
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return "any" if choice.get("mode") == "required" else "auto"
    if isinstance(choice, dict):
        return "auto"  # a hosted tool's choice (web_search, ...): nothing here can run it
    raise InvalidRequestError("tool_choice must be auto, none, required or a function", field="tool_choice")


# -- items to a conversation --------------------------------------------------------------------
def to_conversation(instructions: str | None, items: Iterable[Item], tools: tuple[ToolSpec, ...],
                    choice: str, parallel_tool_calls: bool = True,
                    template_kwargs: tuple[tuple[str, Any], ...] = ()) -> Conversation:
    head = (ChatMessage("system", instructions),) if instructions else ()
    return Conversation((*head, *_messages(items)), tools, choice, parallel_tool_calls, template_kwargs)


def _messages(items: Iterable[Item]) -> Iterator[ChatMessage]:
    names: dict[str, str] = {}
    text: str | None = None  # an assistant turn being gathered
    calls: list[ToolCall] = []
    reasoning = ""  # reasoning items' text, for the assistant turn they come before

    def flush() -> Iterator[ChatMessage]:
        nonlocal text, calls, reasoning
        if text is not None or calls:
            yield ChatMessage("assistant", text or "", tool_calls=tuple(calls), reasoning=reasoning)
            reasoning = ""
        text, calls = None, []

    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            if text is not None or calls:  # reasoning after a turn's text or calls begins the next turn
                yield from flush()
            reasoning += reasoning_of_item(item)
            continue
        if kind == "function_call":
            names[item["call_id"]] = item["name"]
            calls.append(ToolCall(item["call_id"], item["name"], parse_arguments(item["arguments"], "arguments")))
            continue
        if kind == "message" and item["role"] == "assistant" and not calls:
            text = (text + "\n" if text else "") + content_text(item["content"])
            continue
        yield from flush()
        if kind == "message" and item["role"] == "assistant":
            text = content_text(item["content"])
        elif kind == "message":
            reasoning = ""  # reasoning with no assistant turn after it belongs to none
            role = "user" if item["role"] == "user" else "system"
            said, parts = content_parts(item["content"])
            yield ChatMessage(role, said, parts=parts)
        elif kind == "function_call_output":
            output = item["output"]
            said, parts = content_parts(output) if isinstance(output, list) else (output, ())
            yield ChatMessage("tool", said, tool_call_id=item["call_id"], name=names.get(item["call_id"]), parts=parts)
    yield from flush()


def content_text(parts: list[dict[str, Any]]) -> str:
    return "\n".join(_part_text(part) for part in parts)


def content_parts(parts: list[dict[str, Any]]) -> tuple[str, tuple[Part, ...]]:
    """Normalized parts' text, and the parts in order when they hold an image."""
    if not any(part["type"] == "input_image" for part in parts):
        return content_text(parts), ()
    return image_text([from_url(p["image_url"], "input.image_url") if p["type"] == "input_image" else _part_text(p)
                       for p in parts], "\n")


def _part_text(part: dict[str, Any]) -> str:
    if "text" in part:
        return part["text"]
    if part["type"] == "refusal":
        return part["refusal"]
    return _PLACEHOLDERS.get(part["type"], f"[{part['type']}]")


# -- output items -------------------------------------------------------------------------------
def message_item(item_id: str, text: str, status: str = "completed") -> Item:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def reasoning_item(item_id: str, text: str, encrypted: bool, status: str = "completed") -> Item:
    """A turn's reasoning as an output item; with ``encrypted`` (``include: ["reasoning.encrypted_content"]``) it
    also carries the reasoning to send back (reasoning_signature.py)."""
    item: Item = {"id": item_id, "type": "reasoning", "status": status, "summary": [],
                  "content": [{"type": "reasoning_text", "text": text}]}
    if encrypted:
        item["encrypted_content"] = sign(text)
    return item


def function_call_item(item_id: str, call: ToolCall, status: str = "completed") -> Item:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False)}
