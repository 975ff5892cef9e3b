"""Agent export and import on the real SmolLM2: the imported agent resumes from its cache in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.runtime.tiers.agents import Tier
from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.agent_export import export_agent, import_agent
from engine.store.agents_on_disk import DiskTier, ModelKey, list_agents
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.model.engine_fixtures import start_engine
from tests.model.test_engine_real import QUESTIONS, chat_prompt, raw_prompt, without_eos
from tests.support.reference import reference_greedy

ROOT = Path(__file__).resolve().parents[2]
AGENT = "travelling"
MAX_TOKENS = 16


def first_turn(loaded, cache_dir: Path) -> tuple[tuple[int, ...], list[int]]:
    """One turn, then the agent evicted to disk and the engine stopped: only the file remains."""
    engine = start_engine(loaded, store=WarmStore(cache_dir / "agents", stored_model(loaded), 1 << 30, EventLog()))
    try:
        prompt = chat_prompt(loaded, QUESTIONS[2])
        result = run_turn(engine, GenerationRequest(AGENT, prompt, MAX_TOKENS))
        engine.call(lambda e: e.ops.evict_agent(AGENT, Tier.WARM)).result()
        engine.call(lambda e: e._store.flush()).result()
        assert engine.fresh_snapshot().agent(AGENT).tier == "warm"
    finally:
        engine.stop()
    return prompt, result.tokens


def resume_in_fresh_process(cache_dir: Path, model_path: Path, model_cache_dir: Path, prompt: tuple[int, ...]) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.model.resume_script", "--cache-dir", str(cache_dir), "--model", str(model_path),
         "--model-cache-dir", str(model_cache_dir), "--agent", AGENT, "--prompt", json.dumps(list(prompt)),
         "--max-tokens", str(MAX_TOKENS)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(line)


def test_an_imported_agent_resumes_its_whole_cache_in_a_fresh_process(
    smollm2, smollm2_path: Path, model_cache_dir: Path, tmp_path: Path
) -> None:
    prompt, reply = first_turn(smollm2, tmp_path / "first")
    exported = export_agent(tmp_path / "first", AGENT, tmp_path / "agent.safetensors")
    assert exported.n_tokens >= len(prompt) + len(reply) - 1
    imported = import_agent(tmp_path / "second", exported.path,
                            expected_model_key=ModelKey.of_model(smollm2.identity, smollm2.spec))
    assert imported.n_tokens == exported.n_tokens
    assert [(r.agent_id, r.tier, r.n_tokens) for r in list_agents(tmp_path / "second")] == [
        (AGENT, DiskTier.WARM, exported.n_tokens)]
    # The next turn extends the whole cached sequence, so all of it can be reused.
    follow_up = prompt + tuple(reply) + raw_prompt(smollm2, "\nNow say it again, shorter.")
    resumed = resume_in_fresh_process(tmp_path / "second", smollm2_path, model_cache_dir, follow_up)
    assert resumed["tier"] == "warm"
    assert resumed["reuse_source"] == "self"
    assert resumed["reused_tokens"] >= exported.n_tokens - 1
    expected = reference_greedy(smollm2.model, list(follow_up), MAX_TOKENS, set(smollm2.eos_token_ids))
    assert resumed["tokens"] == without_eos(smollm2, expected)
