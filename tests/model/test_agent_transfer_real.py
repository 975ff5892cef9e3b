"""Export an agent from one running server and import it into another, over HTTP, on SmolLM2.

The exported agent is hot on the first server (the export writes its file first); the second
server, on another cache directory, installs it warm; its next turn reads the whole cache back
and decodes what a fresh prefill of the same conversation decodes. A tampered file is refused
with a 400 and changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from engine.formats.rendering import PromptRenderer
from tests.model.real_api import running_api
from tests.support.reference import reference_greedy

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in at most {i + 3} words." for i in range(60))


def send(client: httpx.Client, agent_id: str, text: str) -> dict:
    response = client.post(f"/v1/agents/{agent_id}/messages",
                           json={"content": text, "max_tokens": 10, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_an_agent_exported_from_one_server_resumes_its_whole_cache_on_another(
    smollm2, smollm2_path: Path, tmp_path: Path,
) -> None:
    with running_api(smollm2, tmp_path / "a", smollm2_path) as first, \
            httpx.Client(base_url=first.url, timeout=300) as client:
        client.post("/v1/agents", json={"agent_id": "mover", "system": SYSTEM}).raise_for_status()
        send(client, "mover", "What is rule 3?")
        second = send(client, "mover", "And rule 7?")
        cached = second["usage"]["prompt_tokens"] + second["usage"]["generated_tokens"]
        exported = client.get("/v1/agents/mover/export")
        assert exported.status_code == 200, exported.text
        assert int(exported.headers["x-semantic-tokens"]) >= cached - 1
        assert client.get("/v1/agents/mover").json()["tier"] == "hot"  # exporting moved nothing
        assert client.get("/v1/agents/nobody/export").status_code == 404
    blob = exported.content

    with running_api(smollm2, tmp_path / "b", smollm2_path) as other, \
            httpx.Client(base_url=other.url, timeout=300) as client:
        tampered = bytearray(blob)
        tampered[len(tampered) // 2] ^= 0xFF
        refused = client.post("/v1/agents/import", content=bytes(tampered),
                              headers={"content-type": "application/octet-stream"})
        assert refused.status_code == 400, refused.text
        assert "checksum" in refused.json()["error"]["message"]
        assert client.get("/v1/agents").json()["data"] == []  # nothing changed

        imported = client.post("/v1/agents/import", content=blob, headers={"content-type": "application/octet-stream"})
        assert imported.status_code == 201, imported.text
        body = imported.json()
        assert body["agent"]["tier"] == "warm" and body["conversation_turns"] == 2 and body["tokens"] >= cached - 1
        again = client.post("/v1/agents/import", content=blob, headers={"content-type": "application/octet-stream"})
        assert again.status_code == 409

        text = "Finally, rule 11?"
        conversation = other.app.state.conversations.get("mover")
        prompt = PromptRenderer(smollm2.tokenizer).render(conversation.with_user_message(text))
        eos = set(smollm2.eos_token_ids)
        expected = [t for t in reference_greedy(smollm2.model, list(prompt), 10, eos) if t not in eos]
        result = send(client, "mover", text)
        usage = result["usage"]
        assert usage["reused_tokens"] >= body["tokens"] - 1, usage
        assert result["content"] == smollm2.tokenizer.decode(expected)
