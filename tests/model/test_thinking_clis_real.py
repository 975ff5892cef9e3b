"""The real Claude Code and Codex CLIs, as users run them, against a thinking model folder.

The folder: a tiny random-weight Qwen3.5 (hybrid) under Qwen3.5's upstream
chat template, whose generation prompt opens ``<think>``, with SmolLM2's
tokenizer plus the think markers (tests/model/conftest.thinking_folder). No
real thinking model installs from PyPI, so the replies are random text; what
is checked is the protocol and the cache. The clients are configured only as
their READMEs say (a base URL, a key; Codex's provider in config.toml): no
client option sets the output length. The server caps replies at 48 tokens
(``max_output_tokens``), as a test may, so every reply is short; a random
model rarely writes its end token, so a reply usually ends at that cap, which
Claude Code resumes and Codex reports as an incomplete response, the protocol
working as designed.

Claude Code asks ``thinking: adaptive`` (2.1.328 adds ``display: omitted``)
with effort ``medium``: its replies carry thinking blocks whose signature
carries the reasoning (their text empty when omitted); no marker reaches a text block; the
continued session's turn reads at least 95% of the previous prompt from the
cache (the template drops the earlier reasoning at a new question; the turn
resumes where that reply began; Claude Code also rewrites its history between
runs, so each turn is held to what its prompt shares with the previous one).
Codex asks ``reasoning.summary`` and
``include: reasoning.encrypted_content`` and replays the reasoning items it
got: its resumed run reads at least 95% of the first run's prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
from fastapi import FastAPI

from engine.api.anthropic_schemas import MessagesRequest
from engine.api.anthropic_translate import conversation_of
from engine.api.reasoning_signature import reasoning_of
from engine.formats.rendering import PromptRenderer
from engine.domain.block_layout import common_prefix_length
from tests.model.claude_code_cli import ClaudeCode, install_claude_code, npm_prefix
from tests.model.codex_cli import Codex, install_codex
from tests.model.engine_fixtures import load_folder
from tests.model.real_api import RealApi, running_api
from tests.model.request_log import Exchange, RequestLog
from tests.model.sse_grammar import check_anthropic_stream
from tests.model.test_claude_code_e2e import main_turns

pytestmark = [pytest.mark.model, pytest.mark.solo(reason="the real Claude Code and Codex CLIs, each run held to a time limit")]

MARKUP = ("<think>", "</think>")


@pytest.fixture(scope="module")
def exchanges() -> list[Exchange]:
    return []


@pytest.fixture(scope="module")
def api(thinking_folder, tmp_path_factory, exchanges: list[Exchange]) -> Iterator[RealApi]:
    folder = thinking_folder("qwen3_5")
    loaded = load_folder(folder, tmp_path_factory.mktemp("thinking-cli-load"))

    def record(app: FastAPI) -> None:
        app.add_middleware(RequestLog, exchanges=exchanges)

    with running_api(loaded, tmp_path_factory.mktemp("thinking-cli-cache"), folder, configure=record,
                     max_output_tokens=48, pool_budget_mb=128) as running:
        yield running


def report(api: RealApi, exchanges: list[Exchange], *runs) -> str:
    lines = ["requests the CLI sent:"] + [f"[{n}] {e.summary()}" for n, e in enumerate(exchanges)]
    return "\n".join(lines + ["engine events:", *api.event_lines(), *(run.describe() for run in runs)])


def rendered(api: RealApi, exchange: Exchange) -> list[int]:
    """The prompt tokens the server rendered for a request (the same renderer, the same template)."""
    conversation = conversation_of(MessagesRequest.model_validate(exchange.json()))
    return PromptRenderer(api.engine.loaded.tokenizer).render(conversation)


def test_claude_code_gets_thinking_blocks_and_its_continued_session_reads_the_cache(
        api: RealApi, exchanges: list[Exchange], tmp_path: Path) -> None:
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    claude = ClaudeCode(install_claude_code(npm_prefix()), api.url, home, project)
    seen = len(exchanges)
    first = claude.print_mode("Name one colour.")
    second = claude.print_mode("--continue", "Name another.")
    ours = exchanges[seen:]
    assert first.ended() and second.ended(), report(api, ours, first, second)
    turns = main_turns(ours)
    assert len(turns) >= 2, report(api, ours, first, second)
    for turn in turns:
        body = turn.json()
        assert body["thinking"]["type"] == "adaptive"  # (2.1.197; later versions add display: omitted)
        omitted = body["thinking"].get("display") == "omitted"
        stream = check_anthropic_stream(turn.response.decode())
        thinking = [b for b in stream.blocks if b["type"] == "thinking"]
        assert thinking, report(api, ours, first, second)
        for block in thinking:
            carried = reasoning_of(block["signature"])
            assert carried and block["thinking"] == ("" if omitted else carried)
        assert not any(m in b.get("text", "") for b in stream.blocks for m in MARKUP)
    # Each turn after the first (a resumed reply, the continued session) reads from the cache what its prompt
    # shares with the previous one: the CLI rewrites its history between runs (the continued session sends the
    # resumed replies without the resume messages between them), so that can be less than the whole prompt.
    prompts = [rendered(api, turn) for turn in turns]
    for (before, after), (previous, prompt) in zip(zip(turns, turns[1:]), zip(prompts, prompts[1:])):
        reused, shared = after.usage()["cache_read_input_tokens"], common_prefix_length(previous, prompt)
        print(f"turn: prompt {len(prompt)}, shares {shared} with the previous {len(previous)}, reused {reused}")
        assert reused >= 0.95 * shared, report(api, ours, first, second)
        if shared >= len(previous) - 2:  # it extends the previous prompt (to where that reply began)
            assert reused >= 0.95 * len(previous)
    # How many thinking blocks Claude Code sent back (2.1.197: none, even in a tool loop; the server's reasoning
    # recall, engine/formats/reasoning_recall.py, gives those replies their reasoning again).
    sent_back = [b for m in turns[-1].json()["messages"] if m["role"] == "assistant" and isinstance(m["content"], list)
                 for b in m["content"] if b.get("type") == "thinking"]
    print(f"\nthinking blocks Claude Code sent back: {len(sent_back)}")


def test_codex_gets_reasoning_items_and_its_resumed_run_reads_the_cache(
        api: RealApi, exchanges: list[Exchange], tmp_path: Path) -> None:
    codex = Codex(install_codex(npm_prefix()), api.url, tmp_path / ".codex", tmp_path / "project", "qwen3.5-tiny")
    codex.write_config()
    seen = len(exchanges)
    first = codex.exec("What is 2+2? Answer with the number only.")
    second = codex.exec("resume", "--last", "And 3+3?")
    ours = [e for e in exchanges[seen:] if e.method == "POST" and e.path == "/v1/responses"]
    assert len(ours) >= 2, report(api, exchanges[seen:], first, second)
    for exchange in ours:
        final = exchange.final_response()
        assert final is not None and final["status"] in ("completed", "incomplete"), report(api, ours, first, second)
        reasoning = [item for item in final["output"] if item["type"] == "reasoning"]
        assert reasoning and all(reasoning_of(item["encrypted_content"]) == item["content"][0]["text"]
                                 for item in reasoning)
        assert not any(m in json.dumps(final["output"]) for m in MARKUP)
    # Codex replays the reasoning items it received (store: false), and the resumed run reads the cache.
    replayed = [i for i in ours[-1].json()["input"] if i.get("type") == "reasoning"]
    assert replayed and all(i.get("encrypted_content") for i in replayed)
    before, after = ours[0].usage(), ours[-1].usage()
    assert after["input_tokens_details"]["cached_tokens"] >= 0.95 * before["input_tokens"], \
        report(api, ours, first, second)
