"""``bench/replay.py`` replays a small recorded Claude Code trace against the real server on
SmolLM2: every request is answered, and the ``--continue`` run's turn is served from the
first run's cache, as it was when the trace was recorded from the real CLI."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.model.real_api import running_api
from bench.replay import DEFAULT_TRACE, replay
from bench.trace_format import load_trace


def test_a_recorded_claude_code_trace_replays_on_the_real_model(smollm2, smollm2_path: Path, tmp_path: Path) -> None:
    requests = load_trace(DEFAULT_TRACE)
    assert requests and {r.protocol for r in requests} == {"anthropic"}
    with running_api(smollm2, tmp_path / "cache", smollm2_path) as api:
        # Pauses scaled down: the CLI's start-up between its two runs is not what this test is about.
        turns = asyncio.run(replay(api.url, requests, "anthropic", max_tokens=32, pause_scale=0.1, verbose=False))
        events = api.event_lines()
    assert len(turns) == len(requests)
    assert all(t.ok and t.status == 200 for t in turns), [t for t in turns if not t.ok]
    assert all(0 < t.ttft_s <= t.total_s and t.prompt_tokens > 0 for t in turns)
    # The conversation's session sends its turns in order; the last one resends the whole
    # conversation and most of it comes from the cache of the turns before.
    main = max((t for t in turns), key=lambda t: (t.prompt_tokens, t.turn))
    assert main.reused_tokens > 0.5 * main.prompt_tokens, (main, events)
