"""Memory watermarks on SmolLM2 over HTTP, driven down and up through ``PUT /v1/admin/memory``.

The real machine's memory is whatever it is; moving the watermarks below
and above it forces each path: soft (idle agents go to disk; their next
turns read them back and give the same reply a fresh prefill gives), hard
(new requests refused: Anthropic 529 ``overloaded_error``, OpenAI 503, both
with retry-after), and recovery.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.model.real_api import running_api, wait_for

pytestmark = pytest.mark.model

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _set(api, **limits: float) -> dict:
    response = httpx.put(f"{api.url}/v1/admin/memory", json=limits, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _tier(api, name: str) -> str:
    return next(a["tier"] for a in api.stats()["agents"] if name in a["agent_id"])


def test_watermarks_send_idle_agents_to_disk_refuse_then_recover(smollm2, smollm2_path: Path, tmp_path: Path) -> None:
    with running_api(smollm2, tmp_path / "cache", smollm2_path) as api:
        claude = anthropic.Anthropic(base_url=api.url, api_key="unused")
        gpt = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused")
        first = claude.messages.create(model="m", max_tokens=24, messages=QUESTION, extra_body={"temperature": 0},
                                       extra_headers={"x-claude-code-session-id": "mem-a"})
        gpt.chat.completions.create(model="m", max_tokens=24, temperature=0, messages=QUESTION,
                                    extra_body={"session_id": "mem-b"})
        memory = api.stats()["memory"]
        assert memory["pressure"] == "normal" and memory["system_used_bytes"] < memory["soft_watermark_bytes"]
        used_mb = memory["system_used_bytes"] / 2**20

        # Soft: both idle agents leave the pool for disk.
        assert _set(api, soft_limit_mb=used_mb / 2, hard_limit_mb=used_mb * 4)["pressure"] == "soft"
        wait_for(lambda: _tier(api, "mem-a") == "warm" and _tier(api, "mem-b") == "warm", 30, "agents on disk")
        assert api.stats()["pool"]["used_blocks"] == 0
        # A turn still runs, from the cache read back: the same reply as the first time, all but the new
        # token from the cache.
        again = claude.messages.create(model="m", max_tokens=24, messages=QUESTION, extra_body={"temperature": 0},
                                       extra_headers={"x-claude-code-session-id": "mem-a"})
        assert again.content[0].text == first.content[0].text
        assert again.usage.cache_read_input_tokens >= first.usage.input_tokens - 1, again.usage

        # Hard: refused in each protocol's shape, with retry-after.
        assert _set(api, hard_limit_mb=used_mb / 2)["pressure"] == "hard"
        refused = httpx.post(f"{api.url}/v1/messages", timeout=30, json={"model": "m", "max_tokens": 8,
                                                                         "messages": QUESTION})
        assert refused.status_code == 529 and refused.json()["error"]["type"] == "overloaded_error", refused.text
        assert int(refused.headers["retry-after"]) > 0
        refused = httpx.post(f"{api.url}/v1/chat/completions", timeout=30, json={"model": "m", "max_tokens": 8,
                                                                                 "messages": QUESTION})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0, refused.text

        # Memory "returns": the watermarks go back above it and requests are served again.
        assert _set(api, soft_limit_mb=used_mb * 3, hard_limit_mb=used_mb * 4)["pressure"] == "normal"
        served = gpt.chat.completions.create(model="m", max_tokens=24, temperature=0, messages=QUESTION,
                                             extra_body={"session_id": "mem-b"})
        assert served.choices[0].message.content
        lines = api.event_lines()
        assert any("memory past the soft watermark" in line for line in lines)
        assert any("memory past the hard watermark" in line for line in lines)
        assert any("memory back to normal" in line for line in lines)
