"""Models with recurrent layers, served over HTTP from model folders, as ``semantic --model FOLDER`` serves them.

A hybrid (Qwen3.5: gated delta net layers and attention layers) and a pure
recurrent model (Mamba2): tiny random-weight instances of mlx-lm's own
classes from its test configs, saved as model folders with SmolLM2's
tokenizer and chat template and loaded from the files. Every reply is the
text plain mlx-lm's greedy decoding gives for the same rendered prompt; later
turns read the conversation from the cache; a client that edits its last
message resumes from a snapshot (the usage says so); a second session
starts from the first one's system prompt; an agent evicted to disk (state,
snapshots and attention blocks in one file) comes back after a restart and
exports; a fork and a rewind through the agent API continue from the state
and its snapshots, and agents' turns batched together each say what they
say alone; the pool counts exactly the bytes the caches hold.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine.domain.block_layout import common_prefix_length
from engine.formats.rendering import PromptRenderer
from tests.model.engine_fixtures import load_folder
from tests.model.real_api import RealApi, running_api
from tests.model.test_branching_real import expected_replies, send
from tests.model.test_model_families_real import (SYSTEM, cached, chat, expected_text, expected_turn,
                                                  pool_holds_what_it_counts, rendered, says)
from tests.support.tiny_models import recurrent_family_config, vary

from bench.random_model import write_model_folder

pytestmark = pytest.mark.model

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "granitemoehybrid", "lfm2", "falcon_h1", "mamba2",
            "kimi_linear", "rwkv7"]
# Restart, export, fork and rewind over HTTP on one family of each kind of recurrent layer: gated delta net
# (Qwen3.5), Mamba2 mixer beside attention in one layer (Falcon-H1), short convolution (LFM2), Kimi delta
# attention, RWKV-7. With the engine-level tests' five (tests/unit/test_hybrid_families.py: Qwen3-Next,
# Nemotron-H, LFM2, Mamba2, RWKV-7) every family but Qwen3.5-MoE and Granite-H (the states of Qwen3.5 and
# Nemotron-H) runs them; the four-turn and shared-prefix tests here run on all ten. Saved ~50 s.
LAYER_KINDS = ["qwen3_5", "falcon_h1", "lfm2", "kimi_linear", "rwkv7"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory):
    kind = request.param
    vocab = len(PromptRenderer(load_folder(smollm2_path, tmp_path_factory.mktemp("tok")).tokenizer).tokenizer.vocab)
    folder = write_model_folder(recurrent_family_config(kind, vocab), tmp_path_factory.mktemp(kind) / kind,
                                smollm2_path, "float32", seed=0, transform=vary)
    return kind, folder, load_folder(folder, tmp_path_factory.mktemp(f"{kind}-load"))


@pytest.fixture
def api(family, tmp_path: Path) -> Iterator[RealApi]:
    _, folder, loaded = family
    with running_api(loaded, tmp_path / "cache", folder, pool_budget_mb=64) as running:
        yield running


def test_four_turns_then_an_edit_equal_mlx_lm_and_resume_from_the_cache(family, api: RealApi) -> None:
    _, _, loaded = family
    assert loaded.spec.recurrent_groups
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a sorting algorithm."}]
    said = None
    for turn in range(4):
        reply = chat(api, "four-turns", messages)
        previous, said = said, expected_turn(loaded, messages, said.cached if said else ())
        says(api, loaded, "oa-four-turns", reply.choices[0].message.content, said)
        assert reply.usage.prompt_tokens == len(said.prompt)
        if previous is not None:
            # At least the previous prompt comes from the cache: the state itself when the reply sent back reads
            # as the tokens generated (reply_splice.py), else the snapshot one token short of the previous
            # prompt's end (a state cannot go back in between).
            assert cached(reply) >= len(previous.prompt) - 1, (turn, reply.usage)
        pool_holds_what_it_counts(api)
        messages += [{"role": "assistant", "content": said.text},
                     {"role": "user", "content": f"And turn {turn + 2}?"}]
    # The client rewrites the last question it sent (the fourth turn's; the fifth was never sent): the state
    # stands past it, so the turn resumes from the snapshot taken when the fourth turn began, and computes the rest.
    messages = messages[:-2]
    messages[-1] = {"role": "user", "content": "A different last question."}
    reply = chat(api, "four-turns", messages)
    edited = expected_turn(loaded, messages, said.cached)
    prompt_len = len(edited.prompt)
    says(api, loaded, "oa-four-turns", reply.choices[0].message.content, edited)
    semantic = reply.usage.model_extra["semantic"]
    assert semantic["cache_outcome"] == "snapshot", semantic
    assert 0 < cached(reply) <= semantic["diverged_at"] < prompt_len
    pool_holds_what_it_counts(api)
    stats = api.stats()
    assert any(g["kind"] == "recurrent" and g["used_bytes"] > 0 for g in stats["pool"]["groups"]), stats["pool"]
    agent = next(a for a in stats["agents"] if a["agent_id"].endswith("four-turns"))
    assert agent["checkpoint_bytes"] >= loaded.spec.state_bytes  # its snapshots
    assert agent["state_bytes"] == loaded.spec.state_bytes  # its current state, the same at any length


def test_a_second_session_starts_from_the_first_ones_system_prompt(family, api: RealApi) -> None:
    _, _, loaded = family
    one = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First session asks."}]
    two = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Second session asks other things."}]
    chat(api, "one", one)
    reply = chat(api, "two", two)
    text, _ = expected_text(loaded, two)
    assert reply.choices[0].message.content == text
    # The state can only be taken where a snapshot was kept: at the shared prefix's last whole block.
    shared = common_prefix_length(rendered(loaded, one), rendered(loaded, two))
    assert shared - loaded.spec.block_tokens < cached(reply) <= shared, (shared, reply.usage)
    pool_holds_what_it_counts(api)


@pytest.mark.parametrize("family", LAYER_KINDS, indirect=True)
def test_an_agent_evicted_to_disk_comes_back_after_a_restart_and_exports(family, tmp_path: Path) -> None:
    """The state and its snapshots go to the agent's file with its attention blocks; after a restart the next
    turn reads them and computes only what is new; the agent exports as a file of its own."""
    _, folder, loaded = family
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say something short."}]
    with running_api(loaded, tmp_path / "cache", folder, pool_budget_mb=64) as api:
        first = chat(api, "restart", messages)
        agent = next(a["agent_id"] for a in api.stats()["agents"] if a["agent_id"].endswith("restart"))
        held = api.held_tokens(agent)  # what goes to disk
        response = httpx.post(f"{api.url}/v1/agents/{agent}/evict", json={"tier": "warm"}, timeout=30)
        assert response.status_code == 200, response.text
        view = next(a for a in api.stats()["agents"] if a["agent_id"] == agent)
        assert view["tier"] == "warm", view
        pool_holds_what_it_counts(api)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now after a restart?"}]
    with running_api(loaded, tmp_path / "cache", folder, pool_budget_mb=64) as api:
        said = expected_turn(loaded, messages, held)
        again = chat(api, "restart", messages)
        says(api, loaded, agent, again.choices[0].message.content, said)
        # The state stood one token short of the first prompt's end plus the reply (or at a snapshot there).
        assert cached(again) >= first.usage.prompt_tokens - 1, again.usage
        pool_holds_what_it_counts(api)
        exported = httpx.get(f"{api.url}/v1/agents/{agent}/export", timeout=30)
        assert exported.status_code == 200, exported.text
        assert len(exported.content) > loaded.spec.state_bytes


def as_streamed(text: str) -> str:
    """A decoded reply as the server's streaming detokenizer gives it: without the first token's leading space
    (random weights often start a reply with one)."""
    return text[1:] if text.startswith(" ") else text


@pytest.mark.parametrize("family", LAYER_KINDS, indirect=True)
def test_fork_rewind_and_a_mixed_batch_through_the_agent_api(family, api: RealApi) -> None:
    """The direct agent API on a model with recurrent layers: a fork's first turn continues from its parent's
    state and snapshots; a rewind to the first turn's end resumes from the snapshot kept there; then three
    agents' turns at once, their states side by side in one batch. Every reply is what a fresh prefill of the
    same conversation says."""
    _, _, loaded = family
    with httpx.Client(base_url=api.url, timeout=300) as client:
        client.post("/v1/agents", json={"agent_id": "main", "system": SYSTEM}).raise_for_status()
        for turn in range(2):
            send(client, "main", f"Question {turn}: name one more sorting algorithm.")
        fork = client.post("/v1/agents/main/fork", json={"name": "side"})
        assert fork.status_code == 201, fork.text
        forked = fork.json()
        assert forked["cached_tokens"] > 0 and forked["messages"] == 4, forked
        text = "The fork asks its own question."
        expected = expected_replies(api, loaded, ["side"], [text])[0]
        result = send(client, "side", text)
        assert result["content"] == as_streamed(expected)
        assert result["usage"]["reused_tokens"] >= forked["cached_tokens"] - 1, result["usage"]

        rewound = client.post("/v1/agents/main/rewind", json={"turn": 1})
        assert rewound.status_code == 200, rewound.text
        body = rewound.json()
        assert body["messages"] == 2 and 0 < body["cached_tokens"] <= body["asked_tokens"], body
        text = "Instead: which one is the fastest?"
        expected = expected_replies(api, loaded, ["main"], [text])[0]
        result = send(client, "main", text)
        assert result["content"] == as_streamed(expected)
        assert result["usage"]["reused_tokens"] >= body["cached_tokens"] - 1, result["usage"]
        pool_holds_what_it_counts(api)

    agents, texts = ["main", "side", "third"], ["And after that?", "The fork goes on.", "A new agent asks."]
    with httpx.Client(base_url=api.url, timeout=300) as client:
        client.post("/v1/agents", json={"agent_id": "third", "system": SYSTEM}).raise_for_status()
    # One reference per agent: a shared reference prefill splits the recurrence where the prompts part, and on
    # random weights that rounding can tip a near tie (the engine prefills each prompt its own way too).
    expected = [expected_replies(api, loaded, [a], [t])[0] for a, t in zip(agents, texts)]

    def turn(agent_id: str, text: str) -> dict:
        with httpx.Client(base_url=api.url, timeout=300) as own:  # one connection each: the turns run at once
            return send(own, agent_id, text)

    with ThreadPoolExecutor(len(agents)) as pool:
        results = list(pool.map(turn, agents, texts))
    assert [r["content"] for r in results] == [as_streamed(e) for e in expected]
    assert all(r["usage"]["reused_tokens"] > 0 for r in results[:2]), [r["usage"] for r in results]
    pool_holds_what_it_counts(api)
