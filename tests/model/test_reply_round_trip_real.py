"""A reply that began with a blank, sent back by the client as the text it was given, is read from the cache on
the next turn (scheduler/reply_splice.py), through the real HTTP API.

The detokenizer drops a reply's leading blank (as mlx-lm's does), so the text the client gets and sends back
tokenizes otherwise: before, the next turn diverged at the reply's first token and prefilled the whole reply
again. A tiny random-weight Llama folder (a random model often opens with a blank-led token) with SmolLM2's
byte-level BPE tokenizer and chat template. (Gemma 3's SentencePiece tokenizer, as its GGUF imports, keeps the
blank in the text, so its replies come back as they were written: measured with the same test, no divergence
with or without this.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import mlx.core as mx
import pytest

from bench.random_model import vary, write_model_folder
from engine.api.rendering import PromptRenderer
from engine.domain.chat import ChatMessage, Conversation
from tests.model.engine_fixtures import load_folder
from tests.model.real_api import RealApi, running_api

pytestmark = pytest.mark.model

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
          "tie_word_embeddings": True}


def vocab_size(folder: Path) -> int:
    data = json.loads((folder / "tokenizer.json").read_text())
    return max([*data["model"]["vocab"].values(), *(t["id"] for t in data.get("added_tokens", []))]) + 1


@pytest.fixture(scope="module")
def folder(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder({**CONFIG, "vocab_size": vocab_size(smollm2_path)},
                              tmp_path_factory.mktemp("blank-reply") / "tiny-llama", smollm2_path, "float32", seed=3,
                              transform=vary)


@pytest.fixture(scope="module")
def api(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RealApi, object]]:
    loaded = load_folder(folder, tmp_path_factory.mktemp("load"))
    with running_api(loaded, tmp_path_factory.mktemp("cache"), folder, pool_budget_mb=64) as running:
        yield running, loaded


def blank_led_question(loaded) -> str:
    """A question whose greedy reply opens with a token that decodes with a leading blank."""
    renderer = PromptRenderer(loaded.tokenizer)
    for i in range(64):
        question = f"Question {i}: which file holds the parser?"
        prompt = renderer.render(Conversation((ChatMessage("user", question),)))
        first = int(mx.argmax(loaded.model(mx.array([list(prompt)]))[0, -1]))
        piece = loaded.tokenizer.decode([int(prompt[-1]), first])[len(loaded.tokenizer.decode([int(prompt[-1])])):]
        if piece.startswith(" ") and piece.strip():
            return question
    pytest.fail("no question of 64 gave a reply that opens with a blank")


def test_a_reply_that_began_with_a_blank_is_read_from_the_cache_next_turn(api) -> None:
    running, loaded = api
    question = blank_led_question(loaded)

    def chat(messages: list[dict]) -> dict:
        body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "session_id": "blank-reply", "messages": messages}
        response = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()

    messages = [{"role": "user", "content": question}]
    first = chat(messages)
    answer = first["choices"][0]["message"]["content"]
    assert answer and not answer.startswith(" "), repr(answer)  # the blank the reply began with was dropped
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the tests?"}]
    second = chat(messages)
    history = httpx.get(f"{running.url}/v1/agents/oa-blank-reply", timeout=30).json()["cache_history"]
    turn = history[-1]
    assert turn["outcome"] != "diverged" and turn["divergence"] is None, turn
    assert "its cached tokens were kept" in (turn["note"] or ""), turn
    # Everything the first turn left in the cache serves the second: its prompt and the whole reply.
    assert turn["reused_tokens"] == turn["cached_tokens"], turn
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == turn["reused_tokens"]
