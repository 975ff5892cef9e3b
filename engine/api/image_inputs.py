"""Images as the protocols carry them (base64 blocks, data URLs, web URLs) into ImageParts, and the one check
every image passes before rendering: count, bytes, a readable picture of a bounded size.

Decoding base64 happens while the request is translated (a corrupt string is a 400 naming its field there);
everything that reads pixels or the network (:func:`checked_images`) runs in a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass, replace

from engine.domain.chat import ChatMessage, Conversation, ImagePart
from engine.errors import ImageTooLargeError, InvalidRequestError

# What a model without vision is shown for an image when the server allows that (text_model_images=placeholder).
IMAGE_PLACEHOLDER = "[image omitted: this model cannot read images]"
MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.S)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """The server's limits on images (settings: max_image_mb, max_images_per_request, max_image_pixels,
    allow_image_urls)."""

    max_bytes: int = 20 << 20
    max_images: int = 100
    max_pixels: int = 50_000_000
    allow_urls: bool = False
    url_timeout_s: float = 10.0


def from_base64(data: str, media_type: str, field: str) -> ImagePart:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"{field}: the image data is not valid base64 ({exc})", field=field) from exc
    if not raw:
        raise InvalidRequestError(f"{field}: the image data is empty", field=field)
    return ImagePart(raw, media_type, field)


def from_url(url: str, field: str) -> ImagePart:
    """An image named by a URL: a data URL is decoded now; a web URL is fetched later, where allowed."""
    match = _DATA_URL.match(url)
    if match:
        return from_base64(match.group("data").strip(), match.group("type") or "", field)
    if url.startswith("data:"):
        raise InvalidRequestError(f"{field}: a data URL must be base64 (data:<type>;base64,<data>)", field=field)
    if not url.startswith(("http://", "https://")):
        raise InvalidRequestError(f"{field}: an image URL must be a data: URL or http(s) URL", field=field)
    return ImagePart(b"", "", field, url=url)


def checked_images(conversation: Conversation, limits: ImageLimits) -> Conversation:
    """``conversation`` with every web-URL image fetched (where allowed), after each image is checked: at most
    ``max_images``, each within ``max_bytes`` (413) and ``max_pixels``, and a picture PIL can open. Raises
    InvalidRequestError (400) or ImageTooLargeError (413) naming the field. Reads the network: a worker thread."""
    images = conversation.images
    if len(images) > limits.max_images:
        raise InvalidRequestError(f"{images[limits.max_images].field}: too many images in one request "
                                  f"({len(images)} > max_images_per_request {limits.max_images})",
                                  field=images[limits.max_images].field)
    if not any(image.url for image in images):
        for image in images:
            _check(image, limits)
        return conversation
    messages = tuple(_fetched(message, limits) for message in conversation.messages)
    return replace(conversation, messages=messages)


def _fetched(message: ChatMessage, limits: ImageLimits) -> ChatMessage:
    if not any(isinstance(part, ImagePart) and part.url for part in message.parts):
        for image in message.images:
            _check(image, limits)
        return message
    parts = tuple(_fetch(part, limits) if isinstance(part, ImagePart) and part.url else part
                  for part in message.parts)
    for part in parts:
        if isinstance(part, ImagePart):
            _check(part, limits)
    return replace(message, parts=parts)


def _fetch(image: ImagePart, limits: ImageLimits) -> ImagePart:
    if not limits.allow_urls:
        raise InvalidRequestError(
            f"{image.field}: image URLs are not fetched by this server (a local server fetching URLs a client names "
            "is a risk); send the image as base64, or start the server with --allow-image-urls", field=image.field)
    import httpx

    try:
        with httpx.stream("GET", image.url, timeout=limits.url_timeout_s, follow_redirects=True) as response:
            response.raise_for_status()
            body = bytearray()
            for chunk in response.iter_bytes():
                body.extend(chunk)
                if len(body) > limits.max_bytes:
                    raise _too_large(image.field, len(body), limits, "at least ")
            media_type = response.headers.get("content-type", "").split(";")[0].strip()
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"{image.field}: could not fetch the image URL ({type(exc).__name__}: {exc})",
                                  field=image.field) from exc
    return ImagePart(bytes(body), media_type, image.field)


def _too_large(field: str, size: int, limits: ImageLimits, qualifier: str = "") -> ImageTooLargeError:
    return ImageTooLargeError(f"{field}: the image is {qualifier}{size:,} bytes, over max_image_mb "
                              f"({limits.max_bytes:,} bytes)", field=field)


def _check(image: ImagePart, limits: ImageLimits) -> None:
    if len(image.data) > limits.max_bytes:
        raise _too_large(image.field, len(image.data), limits)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(image.data)) as picture:  # reads the header only: no pixels decoded yet
            width, height = picture.size
            kind = picture.format
    except Image.DecompressionBombError as exc:
        raise InvalidRequestError(f"{image.field}: the image declares more pixels than max_image_pixels "
                                  f"({limits.max_pixels:,}): refused before decoding ({exc})", field=image.field) from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidRequestError(f"{image.field}: not an image this server can read ({type(exc).__name__})",
                                  field=image.field) from exc
    if width * height > limits.max_pixels:
        raise InvalidRequestError(f"{image.field}: the image is {width}x{height} pixels, over max_image_pixels "
                                  f"({limits.max_pixels:,})", field=image.field)
    if kind is None or f"image/{kind.lower()}" not in MEDIA_TYPES + ("image/mpo",):
        raise InvalidRequestError(f"{image.field}: images must be PNG, JPEG, GIF or WebP (got {kind})",
                                  field=image.field)


def image_text(parts: list[str | ImagePart], separator: str = "\n\n") -> tuple[str, tuple[str | ImagePart, ...]]:
    """A message's text (each image a placeholder) and, when it holds an image, its parts: text pieces next to
    each other joined as the text joins them, images where they were (a vision model reads images and text
    joined with nothing between, as chat templates join a list content). Else no parts."""
    text = separator.join(IMAGE_PLACEHOLDER if isinstance(p, ImagePart) else p for p in parts if p)
    if not any(isinstance(p, ImagePart) for p in parts):
        return text, ()
    merged: list[str | ImagePart] = []
    for part in parts:
        if isinstance(part, str) and merged and isinstance(merged[-1], str):
            merged[-1] = f"{merged[-1]}{separator}{part}"
        elif part:
            merged.append(part)
    return text, tuple(merged)
