"""A base model without a chat template (Gemma 3 270M) through the real HTTP API: its reply ends
where it starts the next speaker's paragraph.

The plain format renders ``User: ...\\n\\nAssistant:``. Greedy, Gemma answers
" The capital of France is Paris." and then keeps writing the transcript
("\\n\\nUser: What is the capital of France?\\n\\nAssistant: The capital ..."), which
before ran to the output cap: minutes per answer at ~6 tok/s on this CPU, and the
full-size Claude Code test timed out in CI on such an answer. Now the reply stops
before the marker with an ordinary end of turn, and the next turn still reads its
prompt from the cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from tests.model.real_api import RealApi, running_api
from tests.support.reference import reference_greedy

pytestmark = pytest.mark.model

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def api(gemma3, gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApi]:
    with running_api(gemma3, tmp_path_factory.mktemp("plain-format-cache"), gemma3_path) as running:
        yield running


def ask(api: RealApi, **extra) -> dict:
    body = {"model": "gemma", "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}], **extra}
    response = httpx.post(f"{api.url}/v1/messages", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_base_model_reply_ends_before_it_writes_the_next_user_turn(api: RealApi) -> None:
    reply = ask(api)
    text = reply["content"][0]["text"]
    assert text.strip() == "The capital of France is Paris.", text
    assert reply["stop_reason"] == "end_turn" and reply["stop_sequence"] is None
    # The tokens of "\n\nUser:" were generated (that is how the end was seen), nothing after them.
    assert reply["usage"]["output_tokens"] < 20, reply["usage"]


def test_streamed_the_marker_never_reaches_the_client(api: RealApi) -> None:
    body = {"model": "gemma", "max_tokens": 200, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": QUESTION}]}
    text, stop_reason = "", None
    with httpx.stream("POST", f"{api.url}/v1/messages", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_delta":
                text += event["delta"]["text"]
            elif event["type"] == "message_delta":
                stop_reason = event["delta"]["stop_reason"]
    assert text.strip() == "The capital of France is Paris." and stop_reason == "end_turn", text


def test_a_client_stop_sequence_equal_to_the_marker_is_reported_as_the_clients(api: RealApi) -> None:
    reply = ask(api, stop_sequences=["\n\nUser:"])
    assert reply["stop_reason"] == "stop_sequence" and reply["stop_sequence"] == "\n\nUser:"
    assert reply["content"][0]["text"].strip() == "The capital of France is Paris."


def test_the_next_turn_reads_the_first_from_its_cache(api: RealApi) -> None:
    def chat(messages: list[dict]) -> dict:
        body = {"model": "gemma", "max_tokens": 200, "temperature": 0, "session_id": "plain-two-turns",
                "messages": messages}
        response = httpx.post(f"{api.url}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()

    messages = [{"role": "user", "content": QUESTION}]
    first = chat(messages)
    answer = first["choices"][0]["message"]["content"]
    assert first["choices"][0]["finish_reason"] == "stop" and "\n\nUser:" not in answer
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
    second = chat(messages)
    usage = second["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 8, usage
    # The reply came back without the blank it began with (" The capital ..."): its cached tokens still
    # served it, where before the whole reply was prefilled again from its first token.
    history = httpx.get(f"{api.url}/v1/agents/oa-plain-two-turns", timeout=30).json()["cache_history"]
    assert history[-1]["outcome"] != "diverged", history[-1]
    assert cached >= first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1, usage


# -- /v1/completions: a base model's own endpoint ----------------------------------------------------
RAW_PROMPT = "The three primary colors are"
RAW_TOKENS = 24


def test_a_raw_completion_continues_the_prompt_as_mlx_lm_does(api: RealApi, gemma3) -> None:
    """The OpenAI SDK's text completion, greedy: the prompt's own tokens (BOS and the text, no template)
    continued token for token as plain mlx-lm continues them, the text exactly what follows the prompt (its
    leading blank kept); the same prompt grown by that text reads both from the agent's cache."""
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="local", max_retries=0, timeout=300)
    first = client.completions.create(model="gemma", prompt=RAW_PROMPT, max_tokens=RAW_TOKENS, temperature=0,
                                      extra_body={"session_id": "raw-colors"})
    eos = set(gemma3.eos_token_ids)
    prompt = gemma3.tokenizer.encode(RAW_PROMPT)
    expected = [t for t in reference_greedy(gemma3.model, prompt, RAW_TOKENS, eos) if t not in eos]
    full = gemma3.tokenizer.decode(prompt[1:] + expected)
    text = first.choices[0].text
    assert RAW_PROMPT + text == full, (text, full)
    assert first.usage is not None and first.usage.prompt_tokens == len(prompt)
    assert first.usage.completion_tokens == len(expected) and first.choices[0].finish_reason == "length"

    second = client.completions.create(model="gemma", prompt=RAW_PROMPT + text + "\n\n", max_tokens=4,
                                       temperature=0, extra_body={"session_id": "raw-colors"})
    details = second.usage.prompt_tokens_details if second.usage is not None else None
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= len(prompt) + len(expected) - 1, second.usage
