"""The real Claude Code CLI without ``--bare`` on Gemma 3 270M: full-size requests (~19.6K
tokens of system prompt, 24 tools and reminders), as a user runs it.

One session, two turns (``claude -p``, then ``--continue``), then a second session with a new
session id. The first request pays the prefill of the whole prompt once per suite run; the
continued turn reads its first turn's whole prompt from its own cache, and the new session starts
from the shared prefix (system prompt and tools) the first one computed and stored.

Measured on the 2-core CPU (2026-11-27): the first run 182.8 s (about 90 s of it the prefill of
19,652 tokens, the rest Gemma's 443-token answer at that context); ``--continue`` 76.7 s, first
output after 3.7 s, 19,651 of 20,105 prompt tokens read from cache; the new session 62.7 s, first
output after 12.2 s, 17,920 of 19,651 from the stored prefix. How long a run takes after its first
output is Gemma's sampled answer, so every run is held to a time to first output, not a run time.

Gemma 3 270M is a base model without a chat template: it sees the plain ``User:``/``Assistant:``
format and, once it has answered, goes on writing the transcript (a made-up ``User:`` turn, another
answer, ...). In CI (2026-11-27) the first run's answer ran past the 300 s harness timeout that way,
211 s after its first output, at ~6 tok/s (the tied 262K-row output head, 671 MB of float32, read per
token). Now the reply ends where it starts the next speaker's paragraph (test_plain_format_real.py).

Claude Code resumes a reply cut at ``max_tokens`` up to three times and then exits with status 1
(ClaudeRun.gave_up_at_output_limit). In CI (2026-11-30, Claude Code 2.1.197) Gemma's first answer was
a sampled list of made-up commands without end: cut at the 4,096-token clamp, resumed, cut again,
and the run was killed at 600 s in its third reply. So this server answers greedily (its
``default_temperature``, for requests that name none, as Claude Code's do) and clamps replies to 48
tokens and 20 s: a run is then at most four short, deterministic replies after its prefill, whatever
Gemma writes, and either ending (an answer, or the CLI's output-limit exit) passes; what is asserted is
the cache. The client is run as a user runs it: nothing on its side sets the output length.

Before, the continued turn missed its cache: Claude Code restores a continued session's model from
its replies, and a reply naming the plain model switched it off the 1M-context variant, whose system
prompt differs a thousand tokens in (engine/api/reply_model.py). A retried prompt (the same prompt
again) missed it on Gemma too, tested in test_warm_turns_real.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from fastapi import FastAPI

from tests.model.claude_code_cli import ClaudeCode, install_claude_code, npm_prefix
from tests.model.real_api import RealApi, running_api
from tests.model.request_log import Exchange, RequestLog
from tests.model.test_claude_code_e2e import main_turns, report

pytestmark = pytest.mark.solo(reason="the full-size Claude Code CLI, its first output held to a time limit")

# The first run's first output waits for the one full prefill of the suite (~90-125 s here).
FIRST_RUN_FIRST_OUTPUT_LIMIT_S = 240.0
# The server's clamps for this module: each reply ends by 48 tokens or 20 s after its first token, and the
# CLI sends at most four replies a run (three resumes), so a run is its prefill plus at most ~80 s.
MAX_OUTPUT_TOKENS = 48
MAX_OUTPUT_SECONDS = 20.0
# A hard stop per run, for a hang: the first run's prefill (~90-125 s) plus four clamped replies is ~5 min.
GEMMA_RUN_TIMEOUT_S = 600.0
# A later session's first output: ~1,700 new tokens after the cached prefix (about 11 s of compute here,
# bench_prefill_floor.py), against ~90 s for the whole prompt. The rest of a run is Gemma's sampled answer
# at ~20K tokens of context (~5 tok/s here), as long as the model makes it up to the repetition guard or
# the output cap: bounded by the harness's timeout, not asserted.
FIRST_OUTPUT_LIMIT_S = 45.0


@pytest.fixture(scope="module")
def exchanges() -> list[Exchange]:
    return []


@pytest.fixture(scope="module")
def api(gemma3, gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory,
        exchanges: list[Exchange]) -> Iterator[RealApi]:
    def record(app: FastAPI) -> None:
        app.add_middleware(RequestLog, exchanges=exchanges)

    with running_api(gemma3, tmp_path_factory.mktemp("claude-full-cache"), gemma3_path, configure=record,
                     pool_budget_mb=3072, max_output_tokens=MAX_OUTPUT_TOKENS,
                     max_output_seconds=MAX_OUTPUT_SECONDS, default_temperature=0.0) as running:
        yield running


def prompt_of(usage: dict) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


@pytest.mark.slow(reason="the suite's one full-size Claude Code session: one ~20K-token prefill (~90-125 s here)")
def test_full_size_claude_code_sessions_on_gemma3_reuse_their_cache_and_the_shared_prefix(
    api: RealApi, exchanges: list[Exchange], tmp_path: Path,
) -> None:
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    claude = ClaudeCode(install_claude_code(npm_prefix()), api.url, home, project)

    first = claude.print_mode("Name one colour.", bare=False, timeout_s=GEMMA_RUN_TIMEOUT_S)
    print("\n" + report(api, exchanges, first))
    assert first.ended(), report(api, exchanges, first)
    opening = main_turns(exchanges)
    assert opening, report(api, exchanges, first)
    wait = opening[0].first_output_s
    assert wait is not None and wait < FIRST_RUN_FIRST_OUTPUT_LIMIT_S, report(api, exchanges, first)
    usage = opening[0].usage()
    print(f"\nfirst full-size request: {prompt_of(usage)} prompt tokens, first output after "
          f"{opening[0].first_output_s:.0f} s, {first.seconds:.0f} s for the whole run")
    assert prompt_of(usage) > 12_000 and len(opening[0].json()["tools"]) > 10

    seen = len(exchanges)
    second = claude.print_mode("--continue", "Name another.", bare=False, timeout_s=GEMMA_RUN_TIMEOUT_S)
    print("\n" + report(api, exchanges[seen:], second))
    assert second.ended(), report(api, exchanges, second)
    continued = main_turns(exchanges[seen:])
    assert continued and continued[0].session == opening[-1].session
    usage = continued[0].usage()
    assert usage["cache_read_input_tokens"] > 0.9 * prompt_of(usage), usage

    seen = len(exchanges)
    other = claude.print_mode("Say hello.", bare=False, timeout_s=GEMMA_RUN_TIMEOUT_S)  # no --continue: a new session id
    print("\n" + report(api, exchanges[seen:], other))
    assert other.returncode == 0 or other.gave_up_at_output_limit, report(api, exchanges, other)
    started = main_turns(exchanges[seen:])
    assert started and started[0].session != opening[0].session
    usage = started[0].usage()
    # Everything up to the user's own text is the shared prefix (system prompt, tools, reminders).
    assert usage["cache_read_input_tokens"] > 0.8 * prompt_of(usage), usage
    waits = [turns[0].first_output_s for turns in (continued, started)]
    print(f"\nseconds to first output: --continue, new session: {waits}")
    assert all(wait is not None and wait < FIRST_OUTPUT_LIMIT_S for wait in waits), waits

