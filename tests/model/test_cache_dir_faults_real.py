"""The cache directory removed (``rm -rf``) under a running server on the real
SmolLM2: the server keeps answering, the next eviction recreates the
directory (private, 0700), and an agent whose warm file vanished is served
by prefilling again, with the reply a fresh agent gets for the same prompt."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import httpx

from tests.model.real_api import running_api

QUESTION = "Name three colours."


def ask(client: httpx.Client, session: str, messages: list[dict[str, str]]) -> dict:
    body = {"model": "gpt-4o", "max_tokens": 16, "temperature": 0, "session_id": session, "messages": messages}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def evict(client: httpx.Client, agent_id: str) -> dict:
    response = client.post(f"/v1/agents/{agent_id}/evict", json={"tier": "warm"})
    assert response.status_code == 200, response.text
    return response.json()


def test_removed_cache_directory_keeps_the_server_serving(smollm2, smollm2_path: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with running_api(smollm2, cache, smollm2_path) as api, httpx.Client(base_url=api.url, timeout=120) as client:
        question = [{"role": "user", "content": QUESTION}]
        first = ask(client, "gone", question)
        ask(client, "later", question)
        assert evict(client, "oa-gone")["tier"] == "warm"
        api.engine.call(lambda e: e._store.flush()).result()
        warm_dir = api.engine.call(lambda e: e._store.directory).result()
        assert list(warm_dir.glob("*.safetensors"))

        shutil.rmtree(cache)
        assert ask(client, "meanwhile", question)["choices"][0]["message"]["content"]

        assert evict(client, "oa-later")["tier"] == "warm"
        api.engine.call(lambda e: e._store.flush()).result()
        assert len(list(warm_dir.glob("*.safetensors"))) == 1
        for folder in (cache, cache / "agents", warm_dir):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder

        history = question + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                              {"role": "user", "content": "And three more."}]
        resumed = ask(client, "gone", history)
        fresh = ask(client, "fresh", history)
        # Its own cache is gone: whatever it reuses is a prefix another agent holds.
        assert resumed["usage"]["semantic"]["reuse_source"] != "self"
        assert resumed["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]
        assert any("oa-gone" in line and "warm cache unusable, prefilling" in line for line in api.event_lines())
        assert client.get("/health/ready").status_code == 200
