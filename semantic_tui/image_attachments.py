"""Images in the workbench's chats: ``/image PATH`` in a chat's input attaches a file to the message.

``/image shot.png What does this show?`` sends the picture, then the text, as a pasted screenshot comes
from a client; several ``/image`` words attach several. The transcript shows each image as one line
(name, pixels, format, bytes, the start of its sha256: what names it in the agent's cache). Files are read
on a worker thread, never on the UI's loop.
"""

from __future__ import annotations

import asyncio
import base64
import io
from dataclasses import dataclass
from pathlib import Path

from engine.api.image_inputs import image_text
from engine.domain.chat import ChatMessage, ImagePart
from engine.domain.images import image_digest

COMMAND = "/image"


@dataclass(frozen=True, slots=True)
class Attachment:
    name: str
    image: ImagePart
    width: int
    height: int
    kind: str

    def line(self) -> str:
        size = len(self.image.data)
        amount = f"{size / 1024:.1f} KB" if size < 1 << 20 else f"{size / (1 << 20):.1f} MB"
        return (f"image {self.name} · {self.width}×{self.height} {self.kind} · {amount} · "
                f"sha256 {image_digest(self.image.data)[:12]}")


def split_command(text: str) -> tuple[list[str], str]:
    """The paths ``/image`` words name at the start of ``text`` (a path with spaces in quotes), and the message
    text after them, as typed."""
    paths: list[str] = []
    rest = text.strip()
    while rest.startswith(COMMAND + " "):
        rest = rest[len(COMMAND):].lstrip()
        quote = rest[:1]
        if quote in ("'", '"') and quote in rest[1:]:
            close = rest.index(quote, 1)
            paths.append(rest[1:close])
            rest = rest[close + 1:].lstrip()
        else:
            path, _, rest = rest.partition(" ")
            paths.append(path)
            rest = rest.lstrip()
    return paths, rest


def read_attachment(path: str) -> Attachment:
    """Reads the file and its header; ValueError with a reason a person can act on."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path).expanduser()
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"{COMMAND} {path}: cannot read it ({exc.strerror or exc})") from exc
    try:
        with Image.open(io.BytesIO(data)) as picture:
            width, height, kind = picture.width, picture.height, picture.format or "image"
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{COMMAND} {path}: not an image (PNG, JPEG, GIF or WebP)") from exc
    return Attachment(file.name, ImagePart(data, f"image/{kind.lower()}", COMMAND), width, height, kind)


async def user_message(text: str) -> tuple[ChatMessage, list[Attachment]]:
    """The chat's user message for what was typed: its attachments read (on a worker thread) and put first."""
    paths, said = split_command(text)
    if not paths:
        return ChatMessage("user", text), []
    attachments = [await asyncio.to_thread(read_attachment, path) for path in paths]
    content, parts = image_text([*(a.image for a in attachments), said])
    return ChatMessage("user", content, parts=parts), attachments


def message_body(user: ChatMessage) -> tuple[str, list[str]]:
    """A message as the direct agent API takes it: its text, and its images as data URLs."""
    text = "\n\n".join(part for part in user.parts if isinstance(part, str)) if user.parts else user.content
    images = [f"data:{image.media_type or 'image/png'};base64,{base64.b64encode(image.data).decode()}"
              for image in user.images]
    return text or " ", images
