"""The warm tier on the real models: disk round trips and process restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.runtime.tiers.agents import Tier
from engine.domain.event_log import EventKind, EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.model.engine_fixtures import start_engine
from tests.model.test_engine_real import GEMMA_PROMPTS, QUESTIONS, chat_prompt, raw_prompt

ROOT = Path(__file__).resolve().parents[2]


def first_prompt(loaded) -> tuple[int, ...]:
    if loaded.architecture == "llama":
        return chat_prompt(loaded, QUESTIONS[2])
    return raw_prompt(loaded, GEMMA_PROMPTS[3])


def follow_up(loaded, first, result) -> tuple[int, ...]:
    if loaded.architecture == "llama":
        history = [{"role": "user", "content": QUESTIONS[2]}, {"role": "assistant", "content": result.text}]
        return chat_prompt(loaded, "Now one about mountains.", history)
    return first + tuple(result.tokens) + raw_prompt(loaded, " The end.\n\nChapter two:")[1:]


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_evicted_and_restored_agent_continues_token_identically(request, tmp_path: Path, model_name: str) -> None:
    loaded = request.getfixturevalue(model_name)
    events = EventLog()
    store = WarmStore(tmp_path, stored_model(loaded), 1 << 30, events)
    engine = start_engine(loaded, store=store)
    try:
        prompt = first_prompt(loaded)
        first = run_turn(engine, GenerationRequest("kept", prompt, 16))
        run_turn(engine, GenerationRequest("evicted", prompt, 16))
        second_prompt = follow_up(loaded, prompt, first)
        engine.call(lambda e: e.ops.evict_agent("evicted", Tier.WARM)).result()
        engine.call(lambda e: e._store.flush()).result()
        assert engine.fresh_snapshot().agent("evicted").tier == "warm"
        # The restored agent goes first: were "kept" to run its second turn before, the restore
        # would rightly prefer sharing kept's longer, hot cache to its own from disk.
        restored = run_turn(engine, GenerationRequest("evicted", second_prompt, 16))
        kept = run_turn(engine, GenerationRequest("kept", second_prompt, 16))
        assert restored.tokens == kept.tokens
        assert restored.finish.usage.reuse_source == "self"
        assert restored.finish.usage.reused_tokens > len(prompt)
        assert any("from disk" in e.message for e in engine.events.since(0) if e.kind is EventKind.RESTORE)
    finally:
        engine.stop()


def run_script(cache_dir: Path, model_path: Path, first: int, last: int, replies: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.model.conversation_script", "--cache-dir", str(cache_dir),
         "--model", str(model_path), "--first", str(first), "--last", str(last), "--replies", json.dumps(replies)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_a_fresh_process_continues_the_conversation_from_disk(smollm2_path: Path, tmp_path: Path) -> None:
    uninterrupted = run_script(tmp_path / "a", smollm2_path, 0, 2, [])
    first_process = run_script(tmp_path / "b", smollm2_path, 0, 1, [])
    assert [t["text"] for t in first_process] == [t["text"] for t in uninterrupted[:2]]
    (resumed,) = run_script(tmp_path / "b", smollm2_path, 2, 2, [t["text"] for t in first_process])
    continued = uninterrupted[2]
    assert resumed["tokens"] == continued["tokens"]
    # Everything the first process cached (both turns) is reused after the restart.
    assert resumed["reused"] == continued["reused"] > first_process[1]["prompt"]
