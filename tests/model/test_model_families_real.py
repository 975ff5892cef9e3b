"""Latent attention, layer groups of different geometry, chunked windows: served over HTTP from model folders.

Each family is a tiny random-weight instance of mlx-lm's own class
(``tests/support/tiny_models.py``: weights varied so greedy tokens are not one
repeated token), saved as a model folder with SmolLM2's tokenizer and chat
template, loaded as ``semantic --model FOLDER`` loads it, and served by the
real app. Every reply is the text plain mlx-lm's greedy decoding gives for the
same rendered prompt; later turns read the conversation from the cache (the
usage says how much), also after an eviction to disk and a restart; a second
session with the same system prompt starts from the first one's prefix; a fork
and a rewind continue as a fresh prefill would; the pool counts exactly the
bytes the caches hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import httpx
import openai
import pytest

from engine.formats.rendering import PromptRenderer
from engine.domain.block_layout import common_prefix_length
from engine.domain.chat import ChatMessage, Conversation
from tests.model.engine_fixtures import load_folder
from tests.model.real_api import RealApi, running_api
from tests.support.family_engine import as_the_engine_reads, same_up_to_a_near_tie
from tests.support.reference import reference_greedy
from tests.support.tiny_models import family_config, vary

from bench.random_model import write_model_folder

pytestmark = pytest.mark.model

FAMILIES = ["deepseek_v3", "glm4_moe_lite", "kimi_k25", "gemma4_text", "llama4"]
REPLY = 16
SYSTEM = "You are a terse assistant for a fleet of coding agents. " * 6


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory):
    kind = request.param
    vocab = len(PromptRenderer(load_folder(smollm2_path, tmp_path_factory.mktemp("tok")).tokenizer).tokenizer.vocab)
    folder = write_model_folder(family_config(kind, vocab), tmp_path_factory.mktemp(kind) / kind, smollm2_path,
                                "float32", seed=0, transform=vary)
    return kind, folder, load_folder(folder, tmp_path_factory.mktemp(f"{kind}-load"))


@pytest.fixture
def api(family, tmp_path: Path) -> Iterator[RealApi]:
    _, folder, loaded = family
    with running_api(loaded, tmp_path / "cache", folder, pool_budget_mb=64) as running:
        yield running


def rendered(loaded, messages: list[dict[str, str]]) -> tuple[int, ...]:
    """``messages`` as the server renders them."""
    return PromptRenderer(loaded.tokenizer).render(Conversation(tuple(ChatMessage(m["role"], m["content"])
                                                                      for m in messages)))


@dataclass(frozen=True)
class Said:
    """A turn as plain mlx-lm answers it: its text, the prompt its model read, the tokens it wrote (an end
    marker included)."""

    text: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def cached(self) -> tuple[int, ...]:
        """What the agent's cache holds after the turn: its prompt and every token written."""
        return (*self.prompt, *self.tokens)


def expected_turn(loaded, messages: list[dict[str, str]], cached: Sequence[int] = ()) -> Said:
    """What plain mlx-lm's greedy decoding says to ``messages`` rendered as the server renders them. ``cached``:
    the tokens the agent's cache holds (the last turn's prompt and reply, ``Said.cached``, or as the engine says):
    replies the messages send back as text that tokenizes otherwise are read as the tokens there, as the server
    reads them (engine/runtime/scheduler/reply_splice.py)."""
    prompt = as_the_engine_reads(cached, rendered(loaded, messages), loaded.tokenizer.decode)
    eos = set(loaded.eos_token_ids)
    written = reference_greedy(loaded.model, list(prompt), REPLY, eos)
    # As mlx-lm streams text (its BPE detokenizer drops a reply's leading space, as the server's does).
    detokenizer = loaded.tokenizer.detokenizer
    detokenizer.reset()
    for token in written:
        if token not in eos:
            detokenizer.add_token(token)
    detokenizer.finalize()
    return Said(detokenizer.text, tuple(prompt), tuple(written))


def says(api: RealApi, loaded, agent_id: str, text: str, said: Said) -> None:
    """The agent's reply (``text``, its tokens in the agent's cache) is what plain mlx-lm says (``said``), up to a
    near tie (tests/support/family_engine.py): a reply the cache serves as written was computed a token a step,
    plain mlx-lm prefills it, and random weights put some greedy choices within rounding."""
    if text == said.text:
        return
    held = api.held_tokens(agent_id)
    assert held[:len(said.prompt)] == said.prompt, "the engine read another prompt"
    same_up_to_a_near_tie(loaded, said.prompt, held[len(said.prompt):], said.tokens)


def expected_text(loaded, messages: list[dict[str, str]], cached: Sequence[int] = ()) -> tuple[str, int]:
    """``expected_turn``'s text and the length of the prompt it read."""
    said = expected_turn(loaded, messages, cached)
    return said.text, len(said.prompt)


def chat(api: RealApi, session: str, messages: list[dict[str, str]]) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(api_key="any", base_url=f"{api.url}/v1", max_retries=0, timeout=120)
    return client.chat.completions.create(model="any", messages=messages, max_tokens=REPLY, temperature=0,
                                          extra_body={"session_id": session})


def cached(reply: openai.types.chat.ChatCompletion) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def pool_holds_what_it_counts(api: RealApi) -> None:
    stats = api.stats()
    assert stats["tiers"]["hot_array_bytes"] == stats["pool"]["used_bytes"] - stats["tiers"]["cool_bytes"]
    groups = stats["pool"]["groups"]
    assert sum(g["used_bytes"] for g in groups) == stats["pool"]["used_bytes"] - stats["tiers"]["cool_bytes"]
    metrics = httpx.get(f"{api.url}/metrics", timeout=30).text
    exported = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines() if line.startswith("semantic_pool_group_bytes{")}
    assert exported == {f'group="{g["index"]}",kind="{g["kind"]}"': g["used_bytes"] for g in groups}


def test_four_turns_equal_mlx_lm_and_read_the_conversation_from_the_cache(family, api: RealApi) -> None:
    _, _, loaded = family
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a sorting algorithm."}]
    said = None
    for turn in range(4):
        reply = chat(api, "four-turns", messages)
        previous, said = said, expected_turn(loaded, messages, said.cached if said else ())
        says(api, loaded, "oa-four-turns", reply.choices[0].message.content, said)
        assert reply.usage.prompt_tokens == len(said.prompt)
        if previous is not None:
            # The previous turn's prompt and reply are in the cache (the template closes the reply with tokens
            # the model did not write, which are prefilled).
            assert cached(reply) >= len(previous.prompt), (turn, reply.usage)
        pool_holds_what_it_counts(api)
        messages += [{"role": "assistant", "content": said.text},
                     {"role": "user", "content": f"And turn {turn + 2}?"}]
    groups = api.stats()["pool"]["groups"]
    assert groups and all(g["block_bytes"] == g["pool_blocks_per_block"] * api.stats()["pool"]["block_bytes"]
                          for g in groups)


def test_a_cache_evicted_to_disk_is_read_after_a_restart(family, tmp_path: Path) -> None:
    _, folder, loaded = family
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say something short."}]
    with running_api(loaded, tmp_path / "cache", folder, pool_budget_mb=64) as api:
        first = chat(api, "restart", messages)
        agent = first_agent(api)
        held = api.held_tokens(agent)  # what goes to disk
        response = httpx.post(f"{api.url}/v1/agents/{agent}/evict", json={"tier": "warm"}, timeout=30)
        assert response.status_code == 200, response.text
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now after a restart?"}]
    with running_api(loaded, tmp_path / "cache", folder, pool_budget_mb=64) as api:
        said = expected_turn(loaded, messages, held)
        again = chat(api, "restart", messages)
        says(api, loaded, agent, again.choices[0].message.content, said)
        assert cached(again) >= first.usage.prompt_tokens
        pool_holds_what_it_counts(api)


def first_agent(api: RealApi) -> str:
    agents = [a["agent_id"] for a in api.stats()["agents"]]
    assert len(agents) == 1, agents
    return agents[0]


def test_a_second_session_starts_from_the_first_ones_system_prompt(family, api: RealApi) -> None:
    _, _, loaded = family
    one = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First session asks."}]
    two = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Second session asks other things."}]
    chat(api, "one", one)
    reply = chat(api, "two", two)
    text, _ = expected_text(loaded, two)
    assert reply.choices[0].message.content == text
    # Everything both prompts start with (the system prompt and the template's head) came from the first.
    assert cached(reply) >= common_prefix_length(rendered(loaded, one), rendered(loaded, two)) - 1 > 0
    pool_holds_what_it_counts(api)


def test_fork_and_rewind_continue_as_a_fresh_prefill(family, api: RealApi) -> None:
    _, _, loaded = family
    base = f"{api.url}/v1/agents"
    assert httpx.post(base, json={"agent_id": "trunk", "system": SYSTEM}, timeout=30).status_code in (200, 201)
    said = []
    for question in ("Pick a colour.", "Pick a number."):
        response = httpx.post(f"{base}/trunk/messages", json={"content": question, "max_tokens": REPLY,
                                                             "temperature": 0}, timeout=120)
        assert response.status_code == 200, response.text
        said.append((question, response.json()["content"]))
    fork = httpx.post(f"{base}/trunk/fork", json={"name": "branch", "at_turn": 1}, timeout=60)
    assert fork.status_code in (200, 201), fork.text
    rewind = httpx.post(f"{base}/trunk/rewind", json={"turn": 1}, timeout=60)
    assert rewind.status_code == 200, rewind.text
    for agent in ("branch", "trunk"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": said[0][0]},
                    {"role": "assistant", "content": said[0][1]}, {"role": "user", "content": "Why?"}]
        said_now = expected_turn(loaded, messages, api.held_tokens(agent))
        response = httpx.post(f"{base}/{agent}/messages", json={"content": "Why?", "max_tokens": REPLY,
                                                                 "temperature": 0}, timeout=120)
        assert response.status_code == 200, response.text
        body = response.json()
        says(api, loaded, agent, body["content"], said_now)
        assert body["usage"]["reused_tokens"] > 0, (agent, body["usage"])
    pool_holds_what_it_counts(api)
