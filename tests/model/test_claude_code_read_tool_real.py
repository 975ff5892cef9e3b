"""The real Claude Code CLI calling its Read tool on a PNG, and the picture reaching a vision model through it.

``claude -p "What is in shot.png?"`` in a project holding a PNG, against a tiny Qwen2-VL folder whose language
model is scripted by hand (tests/support/scripted_vlm.py): with no picture in its context it calls
``Read("shot.png")``; Claude Code reads the file and sends it back as an ``image`` block inside the
``tool_result``; with the picture in its context the model answers "It is a picture." The answer is only
written when the server rendered the image into the prompt (a placeholder, a dropped block or an image left
out of a tool result gives another Read call instead), the vision tower ran once, and the second request
read the first one's prompt from the agent's cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model.claude_code_cli import ClaudeCode, install_claude_code, npm_prefix, project_with_png
from tests.model.engine_fixtures import load_folder
from tests.model.real_api import running_api
from tests.model.request_log import Exchange, RequestLog

pytestmark = [pytest.mark.model, pytest.mark.solo(reason="the real Claude Code CLI, held to a time limit")]


def test_claude_code_read_tool_returns_a_png_the_model_sees(smollm2_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("mlx_vlm", reason="the vision extra (pip install 'semantic[vision]') is not installed")
    from tests.support.scripted_vlm import ANSWER_TEXT, READ_PATH, scripted_read_vlm

    folder = scripted_read_vlm(tmp_path / "scripted-vlm", smollm2_path)
    binary = install_claude_code(npm_prefix())
    home, project = project_with_png(tmp_path, READ_PATH, seed=7, width=84, height=56)
    exchanges: list[Exchange] = []
    with running_api(load_folder(folder, tmp_path / "load"), tmp_path / "cache", folder,
                     configure=lambda app: app.add_middleware(RequestLog, exchanges=exchanges)) as api:
        run = ClaudeCode(binary, api.url, home, project).print_mode(f"What is in {READ_PATH}?", bare=False,
                                                                      timeout_s=120)
        vision = api.stats()["throughput"]["vision"]
    summary = "\n".join(e.summary() for e in exchanges) + "\n" + run.describe()
    assert run.returncode == 0 and ANSWER_TEXT in run.stdout, summary
    with_result = [e for e in exchanges if e.path == "/v1/messages" and _tool_result_image(e.json())]
    assert with_result and all(e.status == 200 for e in with_result), summary
    assert vision["images_encoded"] == 1, (vision, summary)
    usage = with_result[0].usage()
    assert usage is not None and usage["cache_read_input_tokens"] > 0, summary


def _tool_result_image(body: dict) -> bool:
    """The request carries a ``tool_result`` whose content holds an ``image`` block (what Read returns)."""
    return any(block.get("type") == "tool_result" and isinstance(block.get("content"), list)
               and any(part.get("type") == "image" for part in block["content"])
               for message in body.get("messages", []) if isinstance(message.get("content"), list)
               for block in message["content"])
