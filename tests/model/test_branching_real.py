"""Fork and rewind on the real models, through the direct agent API over HTTP.

- Eight workers forked from one 2K-token planner on SmolLM2 (eight whole 256-token blocks shared): each fork's first turn prefills only
  its own new tokens, the pool holds the planner's blocks once (every shared block held by all
  nine agents), and greedy outputs equal a fresh prefill of the same prompts.
- Rewind on SmolLM2 and Gemma 3: after three turns, back to the end of the first; the next turn
  equals a fresh prefill of the rewound conversation, and reuses the cache up to the cut.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine.domain.chat import ChatMessage
from engine.formats.rendering import PromptRenderer
from tests.model.real_api import RealApi, running_api
from tests.support.family_engine import as_the_engine_reads
from tests.support.reference import reference_greedy_shared

WORKERS = 8
REPLY = 12


def planner_system(words: int) -> str:
    tasks = " ".join(f"Task {i}: check module {i} for errors and report line {(i * 13) % 97}." for i in range(words // 11))
    return f"You are a planner. Split the work below among workers.\n{tasks}"


def send(client: httpx.Client, agent_id: str, text: str) -> dict:
    response = client.post(f"/v1/agents/{agent_id}/messages", json={"content": text, "max_tokens": REPLY,
                                                                     "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def expected_replies(api: RealApi, loaded, agent_ids: list[str], texts: list[str]) -> list[str]:
    """What fresh prefills of each agent's stored conversation plus its text decode greedily, the replies in it
    read as the tokens the agent's cache holds (as the server reads them: reply_splice.py)."""
    renderer = PromptRenderer(loaded.tokenizer)
    prompts = [as_read(api, loaded, a, renderer.render(api.app.state.conversations.get(a).with_user_message(t)))
               for a, t in zip(agent_ids, texts)]
    eos = set(loaded.eos_token_ids)
    return [loaded.tokenizer.decode([t for t in tokens if t not in eos])
            for tokens in reference_greedy_shared(loaded.model, prompts, REPLY, eos)]


def as_read(api: RealApi, loaded, agent_id: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """``prompt`` as the engine reads it for ``agent_id`` now: where it sends the agent's replies back as text that
    tokenizes otherwise, the tokens its cache holds."""
    return as_the_engine_reads(api.held_tokens(agent_id), prompt, loaded.tokenizer.decode)


@pytest.mark.slow(reason="eight forks of a 2K-token planner, each checked against its plain mlx-lm reference: 45 s "
                          "alone, 73 s beside a second worker")
def test_eight_forks_of_a_planner_share_its_blocks_and_prefill_only_their_own_tokens(
    smollm2, smollm2_path: Path, tmp_path: Path,
) -> None:
    with running_api(smollm2, tmp_path / "cache", smollm2_path, pool_budget_mb=512) as api, \
            httpx.Client(base_url=api.url, timeout=300) as client:
        created = client.post("/v1/agents", json={"agent_id": "planner", "system": planner_system(1250)})
        assert created.status_code == 201, created.text
        plan = send(client, "planner", "Assign the tasks to eight workers.")
        planner_tokens = plan["usage"]["prompt_tokens"] + plan["usage"]["generated_tokens"]
        assert planner_tokens > 2048, plan["usage"]

        forks = []
        for i in range(WORKERS):
            response = client.post("/v1/agents/planner/fork", json={"name": f"worker-{i}"})
            assert response.status_code == 201, response.text
            forks.append(response.json())
        cached = forks[0]["cached_tokens"]
        assert cached >= planner_tokens - 1 and all(f["cached_tokens"] == cached for f in forks)
        assert all(f["shared_tokens"] == cached // 256 * 256 and f["messages"] == 2 for f in forks)
        shared = api.engine.call(lambda e: [b for s in e.agents.get("planner").kv.segments
                                            for b in s.block_ids]).result()
        assert len(shared) >= cached // 256  # every whole block of the planner, in one segment chain
        assert all(api.engine.pool.refcount(b) == WORKERS + 1 for b in shared)

        texts = [f"Worker {i}: do task {i} now." for i in range(WORKERS)]
        expected = expected_replies(api, smollm2, [f"worker-{i}" for i in range(WORKERS)], texts)
        for i, text in enumerate(texts):
            result = send(client, f"worker-{i}", text)
            usage = result["usage"]
            assert usage["reused_tokens"] >= cached - 1, usage
            assert usage["prefilled_tokens"] == usage["prompt_tokens"] - usage["reused_tokens"] < 64, usage
            assert result["content"] == expected[i], (i, result["content"], expected[i])
        assert all(api.engine.pool.refcount(b) == WORKERS + 1 for b in shared)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_rewind_continues_like_a_fresh_prefill_of_the_rewound_conversation(model: str, request, tmp_path: Path) -> None:
    loaded = request.getfixturevalue(model)
    path = request.getfixturevalue(f"{model}_path")
    with running_api(loaded, tmp_path / "cache", path, pool_budget_mb=512) as api, \
            httpx.Client(base_url=api.url, timeout=300) as client:
        client.post("/v1/agents", json={"agent_id": "chat", "system": planner_system(500)}).raise_for_status()
        for turn in range(3):
            send(client, "chat", f"Question {turn}: which task comes after task {turn * 3}?")
        rewound = client.post("/v1/agents/chat/rewind", json={"turn": 1})
        assert rewound.status_code == 200, rewound.text
        body = rewound.json()
        assert body["messages"] == 2 and 0 < body["cached_tokens"] <= body["asked_tokens"]

        text = "Instead: which task is the last one?"
        expected = expected_replies(api, loaded, ["chat"], [text])[0]
        result = send(client, "chat", text)
        assert result["content"] == expected
        assert result["usage"]["reused_tokens"] >= body["cached_tokens"] - 1, result["usage"]

        assert client.post("/v1/agents/chat/rewind", json={"turn": 9}).status_code == 400
        assert client.post("/v1/agents/nobody/rewind", json={"turn": 0}).status_code == 404
        assert client.post("/v1/agents/chat/fork", json={"name": "chat"}).status_code == 409


def test_a_fork_of_an_openai_session_is_a_direct_agent_that_continues_its_context(
    smollm2, smollm2_path: Path, tmp_path: Path,
) -> None:
    """Another client's agent has no conversation the server could copy: its fork is a direct agent
    whose stored conversation starts from the session's cached tokens, and its messages extend them."""
    with running_api(smollm2, tmp_path / "cache", smollm2_path) as api, \
            httpx.Client(base_url=api.url, timeout=300) as client:
        messages = [{"role": "system", "content": planner_system(300)},
                    {"role": "user", "content": "Which task comes first?"}]
        body = {"session_id": "planning", "max_tokens": REPLY, "temperature": 0, "messages": messages}
        first = client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text

        fork = client.post("/v1/agents/oa-planning/fork", json={"name": "side-quest"})
        assert fork.status_code == 201, fork.text
        forked = fork.json()
        assert forked["agent"]["source"] == "api" and forked["cached_tokens"] > 300
        conversation = api.app.state.conversations.get("side-quest")
        assert conversation.context_tokens is not None and len(conversation.context_tokens) == forked["cached_tokens"]

        text = "Now name the last task."
        tail = PromptRenderer(smollm2.tokenizer).continuation((ChatMessage("user", text),))
        prompt = [*conversation.context_tokens, *tail]
        eos = set(smollm2.eos_token_ids)
        expected = reference_greedy_shared(smollm2.model, [prompt], REPLY, eos)[0]
        result = send(client, "side-quest", text)
        assert result["usage"]["reused_tokens"] >= forked["cached_tokens"] - 1, result["usage"]
        assert result["usage"]["prompt_tokens"] == len(prompt)
        assert result["content"] == smollm2.tokenizer.decode([t for t in expected if t not in eos])
        assert smollm2.tokenizer.decode(tail).lstrip().startswith("<|im_start|>user")
        # Its second message extends the first: the conversation grew like any direct agent's.
        again = send(client, "side-quest", "And the one before it?")
        assert again["usage"]["reused_tokens"] >= len(prompt), again["usage"]
