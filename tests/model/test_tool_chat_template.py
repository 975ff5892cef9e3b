"""The tool-aware chat template the benchmarks give random-weight model folders (``bench/random_model.py
--tool-chat-template``): mlx-lm finds a tool parser for it, so both semantic and ``mlx_lm.server`` render a
Claude Code request's tools and tool results through the template, like for like."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from bench.random_model import TOKENIZER_FILES, use_tool_chat_template
from bench.trace_format import load_trace, to_openai

BENCH = Path(__file__).resolve().parents[2] / "bench"


pytestmark = pytest.mark.model


def test_the_tool_template_renders_a_recorded_claude_code_requests_tools_and_results(smollm2_path: Path,
                                                                                      tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine.formats.rendering import PromptRenderer

    for name in TOKENIZER_FILES:
        shutil.copy2(smollm2_path / name, tmp_path / name)
    assert not load_tokenizer(tmp_path).has_tool_calling  # SmolLM2's own template has no tools
    use_tool_chat_template(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.has_tool_calling and PromptRenderer(tokenizer).native_tools
    body = to_openai(load_trace(BENCH / "traces" / "claude_code_tool_turns.jsonl")[-1].body)
    text = tokenizer.apply_chat_template(body["messages"], tools=body["tools"], add_generation_prompt=True,
                                         tokenize=False)
    assert text.count('{"type": "function"') == len(body["tools"])  # every tool definition, in <tools>
    assert text.count("<tool_call>\n{\"name\": \"Read\"") == 2 and text.count("<tool_response>") == 2
    assert "def needs_reorder" in text and text.endswith("<|im_start|>assistant\n")
