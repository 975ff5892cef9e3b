"""Cache-miss forensics on the real SmolLM2 through the HTTP API: a session's second turn whose
system prompt differs only in Claude Code's date line is reported as diverged at that token,
inside the system prompt, with both dates and the span's name, in the agent's cache history,
in usage.semantic and in the Prometheus counter.

(Through the Anthropic API a changed system prompt makes another agent of the same Claude Code
session, which starts from the first one's shared prefix; the OpenAI session keeps one agent.)"""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.model.real_api import running_api

SYSTEM = ("You are a coding agent working in a repository.\n# currentDate\nToday's date is {date}.\n"
          "Answer briefly and use the tools when needed.")


def turn(client: httpx.Client, date: str) -> dict:
    body = {"max_tokens": 8, "temperature": 0, "session_id": "forensics",
            "messages": [{"role": "system", "content": SYSTEM.format(date=date)},
                         {"role": "user", "content": "List the files here."}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_changed_date_line_is_found_in_the_system_prompt(smollm2, smollm2_path: Path, tmp_path: Path) -> None:
    with running_api(smollm2, tmp_path / "cache", smollm2_path) as api, \
            httpx.Client(base_url=api.url, timeout=120) as client:
        turn(client, "2026-11-25")
        second = turn(client, "2026-11-26")
        detail = client.get("/v1/agents/oa-forensics").json()
        metrics = client.get("/metrics").text

    history = detail["cache_history"]
    assert [t["outcome"] for t in history] == ["new_agent", "diverged"]
    divergence = history[-1]["divergence"]
    tokens = smollm2.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM.format(date="2026-11-25")},
         {"role": "user", "content": "List the files here."}], add_generation_prompt=True)
    changed = smollm2.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM.format(date="2026-11-26")},
         {"role": "user", "content": "List the files here."}], add_generation_prompt=True)
    expected = next(i for i, (a, b) in enumerate(zip(tokens, changed)) if a != b)
    assert divergence["token"] == expected and divergence["block"] == expected // 256
    assert divergence["region"] == "system prompt and tools"
    assert "2026-11-25" in divergence["cached_text"] and "2026-11-26" in divergence["prompt_text"]
    assert "currentDate" in divergence["volatile"]
    assert history[-1]["reused_tokens"] == second["usage"]["prompt_tokens_details"]["cached_tokens"] <= expected
    assert second["usage"]["semantic"]["cache_outcome"] == "diverged"
    assert second["usage"]["semantic"]["diverged_at"] == expected
    assert 'semantic_turn_cache_outcomes_total{outcome="diverged"} 1.0' in metrics
