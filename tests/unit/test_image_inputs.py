"""Images in requests, before any model reads them: every protocol's image part reaches the conversation, and
every bad image is a 4xx in the protocol's own shape naming the field (corrupt base64, a decompression bomb,
an oversize image, too many, a URL the server does not fetch, bytes that are no image), checked before the
model is asked. A model without vision refuses images with a 400 that says so, or reads a placeholder where
the server allows it. (Vision models reading them: tests/model/test_vision_real.py.)"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import pytest
from PIL import Image

from engine.api.image_inputs import IMAGE_PLACEHOLDER
from tests.support.router_app import build_app, make_service
from tests.support.scripted_engine import ScriptedEngine


def png(width: int = 8, height: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, "PNG")
    return out.getvalue()


def gif_bomb() -> bytes:
    """A 1x1 GIF whose header declares a 65535x65535 screen: a viewer that trusts it allocates 4 G pixels."""
    out = io.BytesIO()
    Image.new("P", (1, 1)).save(out, "GIF")
    data = bytearray(out.getvalue())
    data[6:10] = b"\xff\xff\xff\xff"
    return bytes(data)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def anthropic_body(*blocks: dict) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [*blocks, {"type": "text", "text": "What is it?"}]}]}


def anthropic_image(data: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(data)}}


def openai_body(url: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]}]}


def responses_body(url: str) -> dict:
    return {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": url}]}]}


async def post(tmp_path: Path, path: str, body: dict, **settings) -> httpx.Response:
    app = build_app(make_service(tmp_path, ScriptedEngine(), **settings))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        return await client.post(path, json=body)


def anthropic_error(response: httpx.Response) -> str:
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] in ("invalid_request_error", "request_too_large")
    return body["error"]["message"]


def openai_error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


async def test_an_image_to_a_text_model_is_a_400_that_says_it_has_no_vision(tmp_path: Path) -> None:
    response = await post(tmp_path, "/v1/messages", anthropic_body(anthropic_image(png())))
    assert response.status_code == 400
    message = anthropic_error(response)
    assert "has no vision" in message and message.startswith("messages.0.content.0.source.data")

    response = await post(tmp_path, "/v1/chat/completions", openai_body(f"data:image/png;base64,{b64(png())}"))
    assert response.status_code == 400
    assert openai_error(response)["param"] == "messages.0.content.1.image_url.url"

    response = await post(tmp_path, "/v1/responses", responses_body(f"data:image/png;base64,{b64(png())}"))
    assert response.status_code == 400 and "has no vision" in openai_error(response)["message"]


async def test_the_placeholder_setting_lets_a_text_model_read_a_note_instead(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    app = build_app(make_service(tmp_path, engine, text_model_images="placeholder"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        response = await client.post("/v1/messages", json=anthropic_body(anthropic_image(png())))
    assert response.status_code == 200
    prompt = engine.loaded.tokenizer.decode(list(engine.requests[-1].prompt_tokens))
    assert f"{IMAGE_PLACEHOLDER}\n\nWhat is it?" in prompt


@pytest.mark.parametrize("data, status, words", [
    (b"not an image at all", 400, "not an image"),
    (gif_bomb(), 400, "max_image_pixels"),
])
async def test_bytes_that_are_no_readable_image_are_refused(tmp_path: Path, data: bytes, status: int, words: str) -> None:
    response = await post(tmp_path, "/v1/messages", anthropic_body(anthropic_image(data)))
    assert response.status_code == status and words in anthropic_error(response)


async def test_corrupt_base64_is_a_400_naming_the_field(tmp_path: Path) -> None:
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}
    response = await post(tmp_path, "/v1/messages", anthropic_body(block))
    assert response.status_code == 400 and "messages.0.content.0.source.data" in anthropic_error(response)
    response = await post(tmp_path, "/v1/chat/completions", openai_body("data:image/png;base64,iVBOR"))
    assert response.status_code == 400 and openai_error(response)["param"] == "messages.0.content.1.image_url.url"
    response = await post(tmp_path, "/v1/responses", responses_body("data:image/png;base64,iVBOR"))
    assert response.status_code == 400 and "input[0].content[1].image_url" in openai_error(response)["message"]


async def test_an_oversize_image_is_a_413_naming_the_field(tmp_path: Path) -> None:
    big = png(400, 400)
    response = await post(tmp_path, "/v1/messages", anthropic_body(anthropic_image(big)), max_image_mb=0.001)
    assert response.status_code == 413
    message = anthropic_error(response)
    assert message.startswith("messages.0.content.0.source.data") and "max_image_mb" in message
    response = await post(tmp_path, "/v1/chat/completions", openai_body(f"data:image/png;base64,{b64(big)}"),
                          max_image_mb=0.001)
    assert response.status_code == 413 and response.json()["error"]["param"] == "messages.0.content.1.image_url.url"


async def test_too_many_images_is_a_400(tmp_path: Path) -> None:
    body = anthropic_body(*[anthropic_image(png())] * 3)
    response = await post(tmp_path, "/v1/messages", body, max_images_per_request=2)
    assert response.status_code == 400
    assert "too many images" in anthropic_error(response) and "max_images_per_request 2" in anthropic_error(response)


async def test_a_url_source_is_refused_unless_the_server_fetches_urls(tmp_path: Path) -> None:
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    response = await post(tmp_path, "/v1/messages", anthropic_body(block))
    assert response.status_code == 400
    message = anthropic_error(response)
    assert message.startswith("messages.0.content.0.source.url") and "--allow-image-urls" in message
    response = await post(tmp_path, "/v1/chat/completions", openai_body("https://example.com/cat.png"))
    assert response.status_code == 400 and "--allow-image-urls" in openai_error(response)["message"]


async def test_an_image_inside_a_tool_result_is_read_like_any_other(tmp_path: Path) -> None:
    """Claude Code's Read tool returns a picture as an image block inside the tool_result."""
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Read shot.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                           "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [anthropic_image(png())]}]}]}
    response = await post(tmp_path, "/v1/messages", body)
    assert response.status_code == 400
    assert anthropic_error(response).startswith("messages.2.content.0.content.0.source.data")


def test_a_stored_conversation_keeps_its_images_across_a_restart(tmp_path: Path) -> None:
    from engine.domain.chat import ChatMessage, ImagePart
    from engine.store.conversations import ConversationStore

    store = ConversationStore(tmp_path)
    store.create("looker", None, None)
    image = ImagePart(png(), "image/png", "images.0")
    user = ChatMessage("user", f"{IMAGE_PLACEHOLDER}\n\nWhat is it?", parts=(image, "What is it?"))
    store.record_turn("looker", user, "A red square.")
    (read_user, reply) = ConversationStore(tmp_path).get("looker").messages
    assert read_user.parts == (ImagePart(png(), "image/png", "images"), "What is it?")
    assert read_user.content == user.content and reply.content == "A red square."
