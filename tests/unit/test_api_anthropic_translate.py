"""Anthropic request bodies to conversations, and pieces to content blocks: no app, no engine."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.api.anthropic_schemas import MessagesRequest
from engine.api.anthropic_stream import ContentBlocks, json_chunks
from engine.api.anthropic_translate import (
    DOCUMENT_PLACEHOLDER,
    IMAGE_PLACEHOLDER,
    conversation_of,
    sampling_of,
    turn_spec,
)
from engine.domain.chat import ChatMessage, ImagePart, ToolCall
from engine.formats.rendering import PromptRenderer
from engine.formats.tools.calls import TextPiece, ToolPiece
from engine.errors import InvalidRequestError
from engine.domain.requests import AgentSource
from tests.support.byte_tokenizer import ByteTokenizer

from .anthropic_helpers import WEATHER_TOOL, body

ENV = "<env>\nWorking directory: /repo\n</env>"


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate(body(**fields))


def tokens(req: MessagesRequest) -> list[int]:
    return PromptRenderer(ByteTokenizer()).render(conversation_of(req))


def claude_code_turn(env_content, billing: str) -> dict:
    """The shape Claude Code 2.1.328 sends, reduced."""
    return body(
        system=[{"type": "text", "text": f"x-anthropic-billing-header: cc_version={billing};"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Main prompt.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "system", "content": env_content}, {"role": "user", "content": "hi"}],
        tools=[dict(WEATHER_TOOL, cache_control={"type": "ephemeral"}, defer_loading=False, strict=True)],
        context_management={"edits": []}, output_config={"effort": "high"},
        thinking={"type": "adaptive", "display": "omitted"}, stream=True, max_tokens=128000,
    )


def test_string_content_and_one_text_block_render_the_same_tokens():
    as_string = request(content="What is 2+2?")
    as_block = request(content=[{"type": "text", "text": "What is 2+2?", "cache_control": {"type": "ephemeral"}}])
    assert tokens(as_string) == tokens(as_block)


def test_claude_code_turns_keep_one_prefix_and_one_agent():
    first = MessagesRequest.model_validate(claude_code_turn([{"type": "text", "text": ENV}], "2.1.328.a1"))
    second = MessagesRequest.model_validate(claude_code_turn(ENV, "2.1.328.b2"))
    headers = {"x-claude-code-session-id": "0b6f4c2e-1111-2222-3333-444455556666"}
    assert tokens(first) == tokens(second)
    one, two = turn_spec(first, headers), turn_spec(second, headers)
    assert one.identity == two.identity and one.identity.source is AgentSource.CLAUDE_CODE
    assert one.identity.agent_id.startswith("cc-0b6f4c2e-1111-2222-3333-444455556666-")


def test_attribution_blocks_are_dropped_and_mid_conversation_system_kept():
    conversation = conversation_of(MessagesRequest.model_validate(claude_code_turn(ENV, "x")))
    assert [m.role for m in conversation.messages] == ["system", "system", "user"]
    assert conversation.messages[0].content == "You are Claude Code.\n\nMain prompt."
    assert conversation.messages[1].content == ENV
    tokenizer = ByteTokenizer()
    assert "x-anthropic" not in tokenizer.decode(PromptRenderer(tokenizer).render(conversation))


def test_empty_string_content_is_accepted():
    req = MessagesRequest.model_validate(body(messages=[{"role": "user", "content": "hi"},
                                                        {"role": "system", "content": ""}]))
    assert conversation_of(req).messages[-1] == ChatMessage("system", "")
    assert tokens(req)


def test_tool_round_trip_becomes_tool_calls_and_results():
    req = request(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "user wants weather", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18C", "is_error": False,
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Thanks"}]},
    ], tools=[WEATHER_TOOL], tool_choice={"type": "auto"})
    conversation = conversation_of(req)
    assert conversation.messages[1] == ChatMessage(
        "assistant", "Checking.", tool_calls=(ToolCall("toolu_01", "get_weather", {"city": "Paris"}),),
        reasoning="user wants weather")  # a signature that is not this server's: the block's own text
    assert conversation.messages[2] == ChatMessage("tool", "18C", tool_call_id="toolu_01", name="get_weather")
    assert conversation.messages[3] == ChatMessage("user", "Thanks")
    assert conversation.tools[0].parameters == WEATHER_TOOL["input_schema"]


def test_tool_result_error_list_content_and_images():
    req = request(content=[{"type": "tool_result", "tool_use_id": "toolu_9", "is_error": True, "content": [
        {"type": "text", "text": "exit 1"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}}]}])
    message = conversation_of(req).messages[0]
    assert message.role == "tool" and message.tool_call_id == "toolu_9"
    assert message.content == f"Error: exit 1\n\n{IMAGE_PLACEHOLDER}"
    # The image itself, in its place, for a vision model (the bytes decoded, the field named for errors).
    assert message.parts == ("Error: exit 1", ImagePart(b"\x89PNG\r\n", "image/png",
                                                           "messages.0.content.0.content.1.source.data"))


def test_corrupt_base64_is_refused_naming_its_field():
    req = request(content=[{"type": "text", "text": "look"},
                           {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}])
    with pytest.raises(InvalidRequestError, match="not valid base64") as caught:
        conversation_of(req)
    assert caught.value.field == "messages.0.content.1.source.data"


def test_images_documents_and_unknown_blocks():
    req = request(content=[
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBER"}},
        {"type": "document", "title": "notes", "source": {"type": "text", "media_type": "text/plain", "data": "a note"}},
        {"type": "server_tool_use_2031", "whatever": [1, 2]},
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "text", "text": "describe"}])
    message = conversation_of(req).messages[0]
    assert message.content == "\n\n".join([IMAGE_PLACEHOLDER, DOCUMENT_PLACEHOLDER, "notes\n\na note", "describe"])
    # A URL image is kept as its URL: fetched only where the server allows it (image_inputs.checked_images).
    assert message.images == (ImagePart(b"", "", "messages.0.content.0.source.url", url="https://example.com/cat.png"),)


@pytest.mark.parametrize("role, block", [
    ("user", {"type": "tool_use", "id": "t", "name": "x", "input": {}}),
    ("assistant", {"type": "tool_result", "tool_use_id": "t", "content": "x"}),
    ("system", {"type": "tool_result", "tool_use_id": "t", "content": "x"}),
])
def test_tool_blocks_in_the_wrong_role_are_invalid(role, block):
    req = request(messages=[{"role": "user", "content": "hi"}, {"role": role, "content": [block]}])
    with pytest.raises(InvalidRequestError, match=r"messages\.1\.content\.0"):
        conversation_of(req)


@pytest.mark.parametrize("choice, expected", [
    (None, "auto"), ({"type": "auto"}, "auto"), ({"type": "any"}, "any"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, "get_weather"),
])
def test_tool_choice(choice, expected):
    fields = {"tools": [WEATHER_TOOL]} | ({"tool_choice": choice} if choice else {})
    assert conversation_of(request(**fields)).tool_choice == expected


def test_tool_choice_tool_needs_a_name():
    with pytest.raises(ValidationError, match="needs the tool's name"):
        request(tool_choice={"type": "tool"})


def test_sampling_leaves_what_the_request_omits_to_the_model_and_honours_explicit_values():
    from engine.api.turns import GREEDY, SamplingAsked
    from engine.models.sampling_defaults import FALLBACK

    assert sampling_of(request()) == SamplingAsked()
    assert sampling_of(request()).resolve(FALLBACK) == FALLBACK.params()
    explicit = sampling_of(request(temperature=0.7, top_p=0.9, top_k=40)).resolve(FALLBACK)
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.seed) == (0.7, 0.9, 40, None)
    assert sampling_of(request(temperature=1.0, top_p=0)) == GREEDY
    assert sampling_of(request(temperature=0)).resolve(FALLBACK).is_greedy


def test_stop_sequences_drop_empty_strings():
    assert turn_spec(request(stop_sequences=["END", ""]), {}).stop == ("END",)


# -- content blocks --------------------------------------------------------------------------------
def test_json_chunks_concatenate_to_the_input():
    value = {"command": "ls -la /tmp", "description": "list files", "n": [1, 2.5, None], "ü": "é"}
    chunks = json_chunks(value)
    assert len(chunks) == 3 and json.loads("".join(chunks)) == value
    assert json_chunks({}) == ["{}"]


def test_blocks_hold_whitespace_and_index_in_order():
    blocks = ContentBlocks()
    call = ToolCall("toolu_1", "get_weather", {"city": "Paris"})
    payloads = blocks.add([TextPiece("\n"), TextPiece(" "), TextPiece("Hi"), ToolPiece(call), TextPiece("\n"),
                           ToolPiece(call), TextPiece("done")]) + blocks.close()
    assert blocks.content == [{"type": "text", "text": "\n Hi"},
                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                              {"type": "text", "text": "done"}]
    starts = [(p["index"], p["content_block"]["type"]) for p in payloads if p["type"] == "content_block_start"]
    stops = [p["index"] for p in payloads if p["type"] == "content_block_stop"]
    assert starts == [(0, "text"), (1, "tool_use"), (2, "tool_use"), (3, "text")] and stops == [0, 1, 2, 3]


def test_only_whitespace_gives_no_block():
    blocks = ContentBlocks()
    assert blocks.add([TextPiece("\n\n")]) + blocks.close() == [] and blocks.content == []


def test_only_the_plain_format_has_turn_ends() -> None:
    class Templated(ByteTokenizer):
        chat_template = "{{ messages }}"

    assert PromptRenderer(ByteTokenizer()).turn_end_strings == ("\n\nUser:", "\n\nAssistant:", "\n\nSystem:")
    assert PromptRenderer(Templated()).turn_end_strings == ()
