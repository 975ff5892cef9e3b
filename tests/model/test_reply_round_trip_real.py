"""A reply that began with a blank, sent back by the client as the text it was given, is read from the cache on
the next turn (scheduler/reply_splice.py), through the real HTTP API, turn after turn.

The detokenizer drops a reply's leading blank (as mlx-lm's does), so the text the client gets and sends back
tokenizes otherwise: before, the next turn diverged at the reply's first token and prefilled the whole reply
again. A tiny random-weight Llama folder (a random model often opens with a blank-led token) with SmolLM2's
chat template and, in turn, two tokenizers: SmolLM2's byte-level BPE, and Gemma 3's SentencePiece vocabulary
with the decoder Hugging Face's SentencePiece tokenizers carry (its ``Strip`` drops a text's first blank; Gemma
3's GGUF import keeps the blank, so its replies come back as they were written).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import mlx.core as mx
import pytest

from bench.random_model import vary, write_model_folder
from engine.formats.rendering import PromptRenderer
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


def sentencepiece_tokenizer(gemma3_path: Path, smollm2_path: Path, out: Path) -> Path:
    """Gemma 3's SentencePiece tokenizer whose decoder strips a text's first blank (as Llama's and Gemma's
    Hugging Face tokenizers do), with SmolLM2's chat template."""
    out.mkdir(parents=True, exist_ok=True)
    data = json.loads((gemma3_path / "tokenizer.json").read_text())
    decoders = data["decoder"]["decoders"] if data["decoder"]["type"] == "Sequence" else [data["decoder"]]
    data["decoder"] = {"type": "Sequence", "decoders": [*decoders, {"type": "Strip", "content": " ", "start": 1,
                                                                    "stop": 0}]}
    (out / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((gemma3_path / "tokenizer_config.json").read_text())
    config["chat_template"] = json.loads((smollm2_path / "tokenizer_config.json").read_text())["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    special = gemma3_path / "special_tokens_map.json"
    if special.is_file():
        (out / "special_tokens_map.json").write_text(special.read_text())
    return out


@pytest.fixture(scope="module", params=["byte-level BPE", "SentencePiece"])
def folder(request, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = smollm2_path
    if request.param == "SentencePiece":
        tokenizer = sentencepiece_tokenizer(request.getfixturevalue("gemma3_path"), smollm2_path,
                                            tmp_path_factory.mktemp("sentencepiece"))
    return write_model_folder({**CONFIG, "vocab_size": vocab_size(tokenizer)},
                              tmp_path_factory.mktemp("blank-reply") / "tiny-llama", tokenizer, "float32", seed=3,
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


def test_replies_that_began_with_a_blank_are_read_from_the_cache_turn_after_turn(api) -> None:
    running, loaded = api
    question = blank_led_question(loaded)

    def chat(messages: list[dict]) -> dict:
        body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "session_id": "blank-reply", "messages": messages}
        response = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()

    messages = [{"role": "user", "content": question}]
    for turn in range(3):
        reply = chat(messages)
        answer = reply["choices"][0]["message"]["content"]
        if turn == 0:
            assert answer and not answer.startswith(" "), repr(answer)  # the blank the reply began with was dropped
        else:
            history = httpx.get(f"{running.url}/v1/agents/oa-blank-reply", timeout=30).json()["cache_history"]
            last = history[-1]
            assert last["outcome"] != "diverged" and last["divergence"] is None, (turn, last)
            # Everything the last turn left in the cache serves this one: its prompt and the whole reply.
            assert last["reused_tokens"] == last["cached_tokens"], (turn, last)
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == last["reused_tokens"]
            if turn == 1:
                assert "its cached tokens were kept" in (last["note"] or ""), last
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And turn {turn + 2}?"}]
