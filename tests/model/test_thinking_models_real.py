"""Thinking models served from model folders with their families' real chat templates, through the Anthropic SDK.

Tiny random-weight Qwen3.5 (hybrid: gated delta nets and attention) and
Qwen3 (attention) instances of mlx-lm's classes under Qwen3.5's upstream
template (bench/templates/thinking), with SmolLM2's tokenizer plus the think
markers. A tool loop as Claude Code runs it (``display: omitted``; the blocks
sent back as received, their text empty) keeps the cache: the template
renders the reasoning the signature carries, and the loop's next turn reads
at least 95% of the previous prompt from the cache. A new question makes
Qwen's template drop every earlier reasoning of the conversation, from the
loop's first reply on: the turn then resumes exactly where that reply began
(the hybrid from the snapshot taken there, GenerationRequest.reply_start),
never earlier. The first reply is the text plain mlx-lm gives for the same
rendered prompt and budget. (gpt-oss's harmony split is checked on the real
architecture in tests/unit/test_reasoning_engine.py: a random model never
closes a harmony header.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import anthropic
import pytest

from engine.api.anthropic_schemas import MessagesRequest
from engine.api.anthropic_translate import conversation_of
from engine.api.reasoning_signature import reasoning_of
from engine.formats.rendering import PromptRenderer
from tests.model.engine_fixtures import load_folder
from tests.model.real_api import RealApi, running_api
from tests.support.reference import reference_ruled

pytestmark = pytest.mark.model

CALC = {"name": "calc", "description": "Evaluate an arithmetic expression",
        "input_schema": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}
BUDGET = 12
# Claude Code's thinking request; the budget named here keeps the tiny model's replies short.
THINKING = {"type": "enabled", "budget_tokens": BUDGET, "display": "omitted"}
MARKUP = ("<think>", "</think>", "<|channel|>", "<|message|>", "<|start|>", "<|end|>")
# A tool result long enough that the turn it ends is most of the next prompt: a resume from before it shows.
TOOL_OUTPUT = "\n".join(f"line {i}: the expression evaluates to {i * 7}" for i in range(40))


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3"])
def served(request, thinking_folder, tmp_path_factory) -> Iterator[tuple[str, RealApi]]:
    kind = request.param
    folder = thinking_folder(kind)
    loaded = load_folder(folder, tmp_path_factory.mktemp(f"{kind}-load"))
    with running_api(loaded, tmp_path_factory.mktemp(f"{kind}-cache"), folder, pool_budget_mb=64,
                     max_output_tokens=40) as api:
        yield kind, api


def ask(client: anthropic.Anthropic, messages: list[dict]) -> anthropic.types.Message:
    return client.messages.create(model="claude-opus-5-5", max_tokens=40, thinking=THINKING, tools=[CALC],
                                  messages=messages, extra_headers={"X-Claude-Code-Session-Id": "thinking-loop"})


def prompt_tokens(message: anthropic.types.Message) -> int:
    usage = message.usage
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def no_markup(message: anthropic.types.Message) -> None:
    for block in message.content:
        text = getattr(block, "text", "") or reasoning_of(getattr(block, "signature", None)) or ""
        assert not any(marker in text for marker in MARKUP), text


def test_the_first_reply_is_what_mlx_lm_gives_with_the_same_budget(served) -> None:
    kind, api = served
    body = {"model": "m", "max_tokens": 40, "thinking": THINKING, "tools": [CALC],
            "messages": [{"role": "user", "content": "What is 6 times 7? Use the tool."}]}
    with anthropic.Anthropic(base_url=api.url, api_key="k", max_retries=0) as client:
        message = client.messages.create(**body, extra_body={"temperature": 0})  # greedy, to compare
    loaded = api.engine.loaded
    tokens = PromptRenderer(loaded.tokenizer).render(conversation_of(MessagesRequest.model_validate(body)))
    eos = set(loaded.eos_token_ids)
    reference = reference_ruled(loaded.model, tokens, 40, eos, loaded.reasoning, BUDGET, loaded.tokenizer.decode)
    assert message.usage.output_tokens == len(reference)
    no_markup(message)
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking == ""  # display: omitted
    # (mlx-lm's streaming detokenizer drops a stream's leading space, as it does for any reply's first token.)
    assert reasoning_of(thinking.signature) == loaded.tokenizer.decode(reference[:BUDGET]).lstrip(" ")
    answer = "".join(b.text for b in message.content if b.type == "text")
    assert answer.strip() == loaded.tokenizer.decode([t for t in reference[BUDGET + 1:] if t not in eos]).strip()


def test_a_tool_loop_and_a_new_question_read_the_previous_prompt_from_the_cache(served) -> None:
    kind, api = served
    messages: list[dict] = [{"role": "user", "content": "What is 6 times 7? Use the tool."}]
    with anthropic.Anthropic(base_url=api.url, api_key="k", max_retries=0) as client:
        first = ask(client, messages)
        # The client runs a tool: the reply's blocks go back as received (thinking text empty), plus the call.
        messages += [{"role": "assistant", "content": [*(b.model_dump(exclude_none=True) for b in first.content),
                                                       {"type": "tool_use", "id": "toolu_1", "name": "calc",
                                                        "input": {"expr": "6*7"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": TOOL_OUTPUT}]}]
        second = ask(client, messages)
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]
                      or [{"type": "text", "text": "(no answer)"}]},
                     {"role": "user", "content": "Thanks. And 8 times 9?"}]
        third = ask(client, messages)
    no_markup(second)
    no_markup(third)
    assert second.usage.cache_read_input_tokens >= 0.95 * prompt_tokens(first), (first.usage, second.usage)
    # The new question: the template renders the loop's replies without their reasoning, from the first one on.
    loop_start = prompt_tokens(first) - 2  # where the first reply began: before the generation prompt's "<think>\n"
    assert third.usage.cache_read_input_tokens == loop_start, (kind, first.usage, third.usage)
