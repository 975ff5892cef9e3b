"""The stream-grammar checkers of the real-model tests must reject what clients reject.

A checker that accepts everything would let the concurrent-streams test
pass on broken streams; these cases pin down that each rule really bites.
"""

from __future__ import annotations

import json

import pytest

from tests.model.sse_grammar import check_anthropic_stream, check_openai_stream


def anthropic_frames(*payloads: dict) -> str:
    return "".join(f"event: {p['type']}\ndata: {json.dumps(p)}\n\n" for p in payloads)


START = {"type": "message_start", "message": {"role": "assistant", "content": [], "usage": {"input_tokens": 3}}}
PING = {"type": "ping"}


def block_start(index: int) -> dict:
    return {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}


def text_delta(index: int, text: str) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}


def block_stop(index: int) -> dict:
    return {"type": "content_block_stop", "index": index}


DELTA = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}
STOP = {"type": "message_stop"}


def test_a_valid_anthropic_stream_with_pings_is_read_back() -> None:
    stream = check_anthropic_stream(anthropic_frames(
        PING, START, block_start(0), text_delta(0, "Hel"), PING, text_delta(0, "lo"), block_stop(0), DELTA, STOP,
    ))
    assert (stream.text, stream.stop_reason, stream.pings) == ("Hello", "end_turn", 2)
    assert stream.final_usage == {"output_tokens": 2}


@pytest.mark.parametrize("frames", [
    pytest.param([block_start(0), START, block_stop(0), DELTA, STOP], id="block-before-message-start"),
    pytest.param([START, text_delta(0, "x"), DELTA, STOP], id="delta-for-unopened-block"),
    pytest.param([START, block_start(0), block_stop(0), text_delta(0, "x"), DELTA, STOP], id="delta-after-stop"),
    pytest.param([START, block_start(1), block_stop(1), DELTA, STOP], id="index-not-from-zero"),
    pytest.param([START, block_start(0), block_start(1), DELTA, STOP], id="two-blocks-open"),
    pytest.param([START, block_start(0), DELTA, STOP], id="message-delta-with-open-block"),
    pytest.param([START, DELTA], id="no-message-stop"),
    pytest.param([START, DELTA, STOP, PING], id="frame-after-message-stop"),
    pytest.param([START, {"type": "error", "error": {"type": "api_error"}}], id="error-event"),
])
def test_broken_anthropic_streams_are_rejected(frames: list[dict]) -> None:
    with pytest.raises(AssertionError):
        check_anthropic_stream(anthropic_frames(*frames))


def openai_frames(*chunks: dict, done: bool = True) -> str:
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return text + ("data: [DONE]\n\n" if done else "")


def chunk(delta: dict | None, finish: str | None = None, chunk_id: str = "c1", usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": chunk_id, "object": "chat.completion.chunk", "created": 1, "choices": choices}
    return body | ({"usage": usage} if usage else {})


USAGE = chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 2})


def test_a_valid_openai_stream_with_keep_alives_is_read_back() -> None:
    role, words = chunk({"role": "assistant", "content": ""}), chunk({"content": "Hi"})
    text = openai_frames(role, words, chunk({}, "stop"), USAGE)
    stream = check_openai_stream(": keep-alive\n\n" + text)
    assert (stream.text, stream.finish_reason, stream.usage["completion_tokens"]) == ("Hi", "stop", 2)


@pytest.mark.parametrize("text", [
    pytest.param(openai_frames(chunk({"role": "assistant"}), chunk({}, "stop"), USAGE, done=False), id="no-done"),
    pytest.param(openai_frames(chunk({"content": "Hi"}), chunk({}, "stop"), USAGE), id="no-role-first"),
    pytest.param(openai_frames(chunk({"role": "assistant"}), chunk({}, "stop", chunk_id="c2"), USAGE), id="ids-differ"),
    pytest.param(openai_frames(chunk({"role": "assistant"}), chunk({"content": "x"}), USAGE), id="no-finish-reason"),
    pytest.param(openai_frames(chunk({"role": "assistant"}), chunk({}, "stop")), id="no-usage-chunk"),
])
def test_broken_openai_streams_are_rejected(text: str) -> None:
    with pytest.raises(AssertionError):
        check_openai_stream(text)
