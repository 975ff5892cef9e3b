"""The workbench's ``/image PATH`` chat command: what it attaches, what the transcript shows, what goes over
the direct API when attached, and a clear line for a file that is no image."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from engine.domain.chat import ImagePart
from engine.domain.images import image_digest
from semantic_tui.image_attachments import message_body, read_attachment, split_command, user_message


def write_png(path: Path, width: int = 64, height: int = 48) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 90)).save(out, "PNG")
    path.write_bytes(out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize("typed, paths, text", [
    ("/image shot.png What is this?", ["shot.png"], "What is this?"),
    ('/image "my shot.png" /image b.jpg  Compare them.', ["my shot.png", "b.jpg"], "Compare them."),
    ("/image a.png", ["a.png"], ""),
    ("What's an /image command?", [], "What's an /image command?"),
])
def test_image_words_at_the_start_name_the_files(typed: str, paths: list[str], text: str) -> None:
    assert split_command(typed) == (paths, text)


async def test_an_attached_image_goes_first_and_shows_as_one_line(tmp_path: Path) -> None:
    data = write_png(tmp_path / "shot.png")
    user, (attachment,) = await user_message(f"/image {tmp_path / 'shot.png'} What is on screen?")
    assert user.parts == (ImagePart(data, "image/png", "/image"), "What is on screen?")
    line = attachment.line()
    assert line.startswith("image shot.png · 64×48 PNG · ") and line.endswith(f"sha256 {image_digest(data)[:12]}")
    # Attached to a server, the direct API takes the text and the image as a data URL.
    text, images = message_body(user)
    assert text == "What is on screen?" and images == [f"data:image/png;base64,{base64.b64encode(data).decode()}"]


async def test_a_plain_message_has_no_parts() -> None:
    user, attachments = await user_message("Hello there")
    assert user.content == "Hello there" and user.parts == () and attachments == []
    assert message_body(user) == ("Hello there", [])


def test_a_missing_file_or_no_image_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read it"):
        read_attachment(str(tmp_path / "nowhere.png"))
    (tmp_path / "notes.txt").write_text("not a picture")
    with pytest.raises(ValueError, match="not an image"):
        read_attachment(str(tmp_path / "notes.txt"))
