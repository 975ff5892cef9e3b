"""The real workbench on a vision model, driven through a pseudo-terminal (tmux): ``/image PATH question``
in a chat sends the picture, the transcript shows it as one line (name, pixels, format, bytes, digest),
the reply comes, and the throughput pane counts the image and the vision tower's time."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support.terminal import TmuxTerminal, isolated_env, semantic_command, tmux_available, wait_until_ready

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not tmux_available(), reason="needs tmux (apt-get install tmux)"),
              pytest.mark.solo(reason="a terminal app in tmux whose screen is read against time limits")]

TIMEOUT_S = 180


def test_a_chat_sends_an_image_and_the_panes_show_it(gemma3_vlm_path: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    out = io.BytesIO()
    Image.fromarray((np.random.RandomState(5).rand(60, 80, 3) * 255).astype("uint8")).save(out, "PNG")
    shot.write_bytes(out.getvalue())
    argv = [*semantic_command(), "--model", str(gemma3_vlm_path), "--cache-dir", str(tmp_path / "cache"),
            "--port", "0", "--default-max-tokens", "40"]
    with TmuxTerminal(tmp_path / "tty") as terminal, terminal.dump_on_failure():
        terminal.start(argv, isolated_env(tmp_path / "home"), cwd=tmp_path)
        wait_until_ready(terminal, TIMEOUT_S)
        terminal.press("n")
        terminal.wait_for_text(r"chat-1 · idle", "the new chat pane", TIMEOUT_S)
        terminal.type_text(f"/image {shot} What is on screen?")
        terminal.wait_for_text(re.escape("What is on screen?"), "the typed message", TIMEOUT_S)
        terminal.press("Enter")
        terminal.wait_for_text(r"▣ image shot\.png · 80×60 PNG · [\d.]+ KB · sha256 [0-9a-f]{12}",
                               "the image's line in the transcript", TIMEOUT_S)
        terminal.wait_for_text(r"prefilled ([\d,]+) · generated ([\d,]+)", "the reply's usage line", TIMEOUT_S)
        terminal.wait_for_text(r"gen 40 · prefill \d+ · reused \d+ · img 1 in \d+(ms|\.\d+s)",
                               "the throughput pane's image count and tower time", TIMEOUT_S)
