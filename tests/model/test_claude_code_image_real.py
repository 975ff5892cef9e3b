"""The real Claude Code CLI (npm) sending a picture to a vision model, as a user types it.

``claude -p "Describe @shot.png in one line."`` in a project holding a PNG: Claude Code reads the file and
sends it as an ``image`` block with the prompt. The server (a tiny random-weight Gemma 3 vision model, built
from mlx-vlm's classes) must take it: every request answered, the image through the vision tower once, and
each later request of the session (the CLI resumes a reply cut at the server's output cap) reading the image
from the agent's cache rather than computing it again. A random model writes no end token, so the CLI ends
at its own output limit after its resumes (ClaudeRun.gave_up_at_output_limit) or with an answer.

(An image inside a ``tool_result``, as the Read tool returns one, needs a model that calls the tool:
tests/model/test_claude_code_read_tool_real.py drives the real Read tool with a hand-scripted model.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model.claude_code_cli import ClaudeCode, install_claude_code, npm_prefix, project_with_png
from tests.model.engine_fixtures import load_folder
from tests.model.real_api import running_api
from tests.model.request_log import Exchange, RequestLog

pytestmark = [pytest.mark.model, pytest.mark.solo(reason="the real Claude Code CLI, held to a time limit")]


def test_claude_code_sends_a_png_the_vision_model_reads_once(gemma3_vlm_path: Path, tmp_path: Path) -> None:
    binary = install_claude_code(npm_prefix())
    home, project = project_with_png(tmp_path, "shot.png", seed=5, width=80, height=60)
    exchanges: list[Exchange] = []
    loaded = load_folder(gemma3_vlm_path, tmp_path / "load")
    with running_api(loaded, tmp_path / "cache", gemma3_vlm_path, max_output_tokens=64,
                     configure=lambda app: app.add_middleware(RequestLog, exchanges=exchanges)) as api:
        # Not --bare: a bare run sends "@shot.png" as text (Claude Code 2.1).
        run = ClaudeCode(binary, api.url, home, project).print_mode("Describe @shot.png in one line.", bare=False,
                                                                      timeout_s=240)
        vision = api.stats()["throughput"]["vision"]
    with_image = [e for e in exchanges if e.path == "/v1/messages" and _has_image(e.json())]
    summary = "\n".join(e.summary() for e in exchanges) + "\n" + run.describe()
    assert run.ended(), summary
    assert with_image and all(e.status == 200 for e in with_image), summary
    # Once through the tower: the session's later requests read the image from the agent's cache.
    assert vision["images_encoded"] == 1, (vision, summary)
    for later in with_image[1:]:
        usage = later.usage()
        assert usage is not None and usage["cache_read_input_tokens"] > 0, summary


def _has_image(body: dict) -> bool:
    return any(isinstance(m.get("content"), list) and any(b.get("type") == "image" for b in m["content"])
               for m in body.get("messages", []))
