"""A thinking model in a Claude Code tool loop: reuse per turn and warm-turn TTFT, semantic vs mlx_lm.server.

    python -m bench.bench_thinking_loop --model FOLDER [--turns 10] [--repeats 2] [--json PATH]

FOLDER is a thinking model (``bench/random_model.py --thinking-template``).
The loop has the shape of the recorded Claude Code session
(``traces/claude_code_tool_turns.jsonl``: its system prompt, 24 tools, first
user message, ``thinking: adaptive`` with ``output_config.effort: medium``),
then ``--turns`` tool rounds: each reply goes back as the API asks (semantic's
thinking blocks with their signatures; ``--thinking-back omitted`` drops them,
as Claude Code 2.1.197 does: the random model writes no call of its own, so
the Read call this script adds makes each reply one semantic did not write,
its reasoning recall does not match, and what is measured is the fallback,
resuming where each reply began; for the peer the
``reasoning`` it returned, sent back as ``reasoning_content``, the field its
template reads: the peer's best case) followed by a tool call and its result
(a file of about ``--result-tokens`` tokens, different every round), all
after one user question, as in a coding agent's tool loop.

semantic gets the Anthropic body, streamed; ``mlx_lm.server`` (``python -m
mlx_lm.server --model FOLDER``, at its defaults) gets the same conversation as
OpenAI chat, streamed. Both replies are capped at ``--max-tokens``. Per turn:
prompt tokens, tokens each server says it read from its cache, and TTFT (to
the first streamed output: a thinking or text delta, reasoning or content).
The servers run one at a time, alternating which goes first per repeat; the
ratios are the peer's TTFT over semantic's, per warm turn and summed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import base_parser
from bench.peer_runs import load_average
from bench.results import BenchResult, compare, recorded
from bench.served import Batching, peer_defaults_launch, running, semantic_launch
from bench.trace_format import load_trace, to_openai

TRACE = Path(__file__).parent / "traces" / "claude_code_tool_turns.jsonl"
SESSION = "bench-thinking-loop"


@dataclass(slots=True)
class Turn:
    ttft_s: float
    prompt_tokens: int
    reused_tokens: int
    output_tokens: int
    reasoning: str = ""
    text: str = ""
    blocks: list[dict[str, Any]] = field(default_factory=list)  # semantic's content blocks, as received


def tool_result(round_: int, tokens: int) -> str:
    """A file the Read tool returned: numbered source lines, different every round (about ``tokens`` tokens)."""
    lines = [f"{n:4d}\tdef step_{round_}_{n}(value):  # round {round_}, line {n}\n" for n in range(1, tokens // 12 + 1)]
    return "".join(lines)


def first_body(max_tokens: int) -> dict[str, Any]:
    recorded_body = load_trace(TRACE)[0].body
    return {**recorded_body, "max_tokens": max_tokens, "stream": True}


def rounds(body: dict[str, Any], history: list[Turn], result_tokens: int, thinking_back: str = "signed"
           ) -> dict[str, Any]:
    """The Anthropic conversation after ``history``'s replies, each followed by a Read call and its result.
    ``thinking_back``: "omitted" drops each reply's thinking blocks (what Claude Code sends), "signed" keeps them."""
    messages = list(body["messages"])
    for index, turn in enumerate(history):
        call = {"type": "tool_use", "id": f"toolu_{index:04d}", "name": "Read",
                "input": {"file_path": f"/project/src/module_{index}.py"}}
        blocks = [b for b in turn.blocks if thinking_back == "signed" or b["type"] != "thinking"]
        messages.append({"role": "assistant", "content": [*blocks, call]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                                      "content": tool_result(index, result_tokens)}]})
    return {**body, "messages": messages}


def peer_body(anthropic_body: dict[str, Any], history: list[Turn]) -> dict[str, Any]:
    """The same conversation as OpenAI chat; each reply's reasoning back as ``reasoning_content``. Claude Code's
    mid-conversation system message is folded into the user turn beside it, as semantic renders it for a template
    that refuses it (Qwen3.5's raises "System message must be at the beginning."; mlx_lm.server answers 404)."""
    body = to_openai(anthropic_body)
    body["messages"] = fold_system(body["messages"])
    replies = iter(history)
    for message in body["messages"]:
        if message["role"] == "assistant":
            turn = next(replies)
            message["content"] = turn.text
            if turn.reasoning:
                message["reasoning_content"] = turn.reasoning
    return {**body, "stream_options": {"include_usage": True}}


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages after the first message become user text, merged with a user message beside them
    (engine/formats/rendering.py's _alternating does the same)."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if message["role"] == "system" and index > 0:
            message = {"role": "user", "content": f"[system]\n{message['content']}"}
        if out and out[-1]["role"] == message["role"] == "user":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{message['content']}"}
        else:
            out.append(message)
    return out


async def semantic_turn(client: httpx.AsyncClient, body: dict[str, Any]) -> Turn:
    started, first = time.perf_counter(), None
    blocks: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    headers = {"x-claude-code-session-id": SESSION, "anthropic-version": "2023-06-01"}
    async with client.stream("POST", "/v1/messages", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event["type"]
            if kind == "message_start":
                usage.update(event["message"]["usage"])
            elif kind == "content_block_start":
                blocks.append(dict(event["content_block"]))
            elif kind == "content_block_delta":
                first = first or time.perf_counter()
                delta, block = event["delta"], blocks[event["index"]]
                for key in ("text", "thinking", "signature"):
                    if key in delta:
                        block[key] = block.get(key, "") + delta[key]
            elif kind == "message_delta":
                usage.update(event["usage"])
    reused = int(usage.get("cache_read_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + reused + int(usage.get("cache_creation_input_tokens") or 0)
    blocks = [b for b in blocks if b["type"] != "tool_use"]
    return Turn((first or time.perf_counter()) - started, prompt, reused, int(usage.get("output_tokens") or 0),
                "".join(b.get("thinking", "") for b in blocks), "".join(b.get("text", "") for b in blocks), blocks)


async def peer_turn(client: httpx.AsyncClient, body: dict[str, Any]) -> Turn:
    started, first = time.perf_counter(), None
    reasoning, text, usage = [], [], {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                said = delta.get("reasoning") or delta.get("reasoning_content") or ""
                if said or delta.get("content"):
                    first = first or time.perf_counter()
                reasoning.append(said)
                text.append(delta.get("content") or "")
    details = usage.get("prompt_tokens_details") or {}
    return Turn((first or time.perf_counter()) - started, int(usage.get("prompt_tokens") or 0),
                int(details.get("cached_tokens") or 0), int(usage.get("completion_tokens") or 0),
                "".join(reasoning), "".join(text))


async def loop(url: str, peer: bool, args: argparse.Namespace) -> list[Turn]:
    base = first_body(args.max_tokens)
    history: list[Turn] = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0)) as client:
        for index in range(args.turns + 1):
            body = rounds(base, history, args.result_tokens, args.thinking_back)
            turn = await (peer_turn(client, peer_body(body, history)) if peer else semantic_turn(client, body))
            history.append(turn)
            print(f"#   turn {index:2d}: prompt {turn.prompt_tokens:6d}, read from cache {turn.reused_tokens:6d} "
                  f"({share(turn):5.1%}), TTFT {turn.ttft_s:7.3f} s, {turn.output_tokens} out "
                  f"({len(turn.reasoning)} chars reasoning, {len(turn.text)} text)", flush=True)
    return history


def share(turn: Turn) -> float:
    return turn.reused_tokens / turn.prompt_tokens if turn.prompt_tokens else 0.0


def of_previous(turns: list[Turn], index: int) -> float:
    """The turn's tokens read from the cache over the previous turn's prompt (the issue's measure)."""
    return turns[index].reused_tokens / turns[index - 1].prompt_tokens if index else 0.0


def new_result(args: argparse.Namespace) -> BenchResult:
    folder = Path(args.model)
    return BenchResult("bench_thinking_loop", f"A thinking model in a Claude Code tool loop ({folder.name}): "
                       "semantic vs mlx_lm.server at its defaults",
                       args={"model": str(folder), "turns": args.turns, "repeats": args.repeats,
                             "max_tokens": args.max_tokens, "result_tokens": args.result_tokens, "trace": TRACE.name,
                             "thinking_back": args.thinking_back})


def run(args: argparse.Namespace, result: BenchResult) -> None:
    folder = Path(args.model)
    runs: dict[str, list[list[Turn]]] = {"semantic": [], "mlx_lm.server": []}
    with tempfile.TemporaryDirectory(prefix="bench-thinking-") as work:
        launches = (semantic_launch(folder, Path(work) / "state", args.pool_mb, Batching()),
                    peer_defaults_launch(folder))
        for repeat in range(args.repeats):
            for launch in launches if repeat % 2 == 0 else launches[::-1]:
                print(f"# run {repeat + 1}/{args.repeats}, {launch.name} ({load_average()})", flush=True)
                with running(launch, Path(work)) as server:
                    runs[launch.name].append(asyncio.run(loop(server.url, launch.name != "semantic", args)))
    ours, theirs = runs["semantic"], runs["mlx_lm.server"]
    for index in range(1, args.turns + 1):
        result.comparisons.append(compare(f"turn {index}", "TTFT", "s", [r[index].ttft_s for r in ours],
                                          [r[index].ttft_s for r in theirs], target=2.0))
    result.comparisons.append(compare("warm turns", "sum of TTFT", "s", [sum(t.ttft_s for t in r[1:]) for r in ours],
                                      [sum(t.ttft_s for t in r[1:]) for r in theirs], target=2.0))
    for name, repeats in runs.items():
        for index in range(1, args.turns + 1):
            result.metric(name, f"turn {index}: read from cache / previous prompt",
                          100 * min(of_previous(r, index) for r in repeats), "%", target=95.0 if name == "semantic"
                          else None)
        result.metric(name, "lowest reuse of the previous prompt, warm turns",
                      100 * min(of_previous(r, i) for r in repeats for i in range(1, args.turns + 1)), "%")
        result.metric(name, "median warm TTFT", statistics.median(t.ttft_s for r in repeats for t in r[1:]), "s",
                      better="lower")
    back = ("each reply sent back without its thinking block, as Claude Code 2.1.197 does (with this script's "
            "added calls the recall cannot match: the fallback)" if args.thinking_back == "omitted"
            else "each reply sent back with its signed thinking blocks")
    result.notes.append("semantic: Anthropic Messages as Claude Code sends them (thinking adaptive, effort medium: "
                        f"a budget of 3/4 of max_tokens {args.max_tokens}; {back}); the peer: the same conversation as "
                        "OpenAI chat, each reply's reasoning sent back as reasoning_content (its template renders it "
                        "in the tool loop), no budget (it has none).")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = base_parser(__doc__.splitlines()[0])
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--turns", type=int, default=10, help="tool rounds after the first turn (default 10)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per server, alternating (default 2)")
    parser.add_argument("--max-tokens", type=int, default=64, help="each reply's max_tokens (default 64)")
    parser.add_argument("--result-tokens", type=int, default=400,
                        help="about how many tokens each tool result has (default 400)")
    parser.add_argument("--thinking-back", choices=("signed", "omitted"), default="signed",
                        help="how semantic gets its replies back: 'signed' with their thinking blocks and signatures, "
                             "as the API asks (default); 'omitted' without them, as Claude Code 2.1.197 sends them "
                             "(measures the resume-where-the-reply-began fallback, see above)")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns, args.repeats = 3, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(f"bench_thinking_loop: --model must be a model folder (bench/random_model.py --thinking-template); "
              f"got {args.model!r}", file=sys.stderr)
        return 2
    with recorded(new_result(args), args.json) as result:
        run(args, result)
        for c in result.comparisons:
            print(f"{c.workload:12s} TTFT semantic {c.semantic.median:7.3f} s, mlx_lm.server {c.peer.median:7.3f} s, "
                  f"x{c.advantage.median:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
