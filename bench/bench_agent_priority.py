"""The agent a person waits on, while subagents load the machine: a Claude Code-shaped session.

A main agent has a cached history (~1K tokens) and sends a warm turn (~80 new tokens): first alone, then (a
second main agent of the same shape) while six subagents start ~1.5K-token turns and one more subagent sends a
~5K-token prompt, the main turn arriving ~1.5 s after them. Streaming, greedy. semantic gets Claude Code's
Anthropic requests with its real headers (``x-claude-code-session-id``, a subagent's ``x-claude-code-agent-id``);
mlx_lm.server speaks only OpenAI chat completions and gets the same conversations that way. Three servers, one at
a time, order rotating per repeat: semantic (priorities and paced prefill on, its defaults), semantic with both
off (``--no-priorities --decode-gap-ms 0``: first come, first served, whole prefill chunks), semantic with the
pacer's gap at 750 ms (``--decode-gap-ms 750``: the knob turned toward throughput), and mlx_lm.server at its
defaults; on request (``--servers``) semantic with ``--speculate off``, where the main reply's first word waits for
the decode steps after its prefill.

Measured: the main turn's time to first token alone and loaded (target: loaded within 1.5x of alone), the
longest gap between two tokens of a decoding subagent (target: at most 1 s), subagents' tokens per second, and
all agents' tokens over the loaded phase's wall time (target: at least 0.95x of priorities off).

Run: ``LD_PRELOAD=... python -m bench.bench_agent_priority [--quick] [--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.bench_vs_mlx_lm_server import model_folder
from bench.common import base_parser
from bench.peer_runs import load_average
from bench.results import BenchResult, compare
from bench.served import Batching, Launch, peer_defaults_launch, running, semantic_launch

SUBAGENTS = 6
MAIN_OUT, SUB_OUT = 48, 96
LOAD_HEAD_START_S = 1.5


@dataclass(slots=True)
class Stream:
    """One streamed turn: when it was sent, when each piece of text came, and the text."""

    agent: str
    sent_at: float
    pieces: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def ttft_s(self) -> float:
        return self.pieces[0] - self.sent_at if self.pieces else float("inf")

    @property
    def longest_gap_s(self) -> float:
        gaps = [b - a for a, b in zip(self.pieces, self.pieces[1:])]
        return max(gaps, default=0.0)


def lines(n: int, what: str) -> str:
    return "\n".join(f"{what} {i}: value = compute({i}, {i * 7 % 13}); check(value)" for i in range(n))


def history(name: str) -> list[dict[str, str]]:
    """A main agent's conversation so far: ~1K tokens of code and talk."""
    return [{"role": "user", "content": f"Here is {name}.py:\n{lines(40, name)}\nWhat does it do?"}]


class Client:
    """Streams turns to one server: Anthropic Messages with Claude Code's headers (semantic), else OpenAI chat."""

    def __init__(self, url: str, anthropic: bool) -> None:
        self.anthropic = anthropic
        self.http = httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=32))

    async def turn(self, agent: str, session: str, subagent: bool, messages: list[dict[str, str]],
                   max_tokens: int) -> Stream:
        stream = Stream(agent, time.perf_counter())
        if self.anthropic:
            headers = {"x-api-key": "local", "anthropic-version": "2023-06-01", "x-claude-code-session-id": session}
            if subagent:
                headers["x-claude-code-agent-id"] = agent
            body: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": max_tokens, "temperature": 0,
                                    "stream": True, "messages": messages}
            path = "/v1/messages"
        else:
            headers = {}
            body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "messages": messages}
            path = "/v1/chat/completions"
        async with self.http.stream("POST", path, json=body, headers=headers) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                text = self._text(line)
                if text:
                    stream.pieces.append(time.perf_counter())
                    stream.text += text
        return stream

    def _text(self, line: str) -> str:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return ""
        data = json.loads(line[6:])
        if self.anthropic:
            delta = data.get("delta") or {}
            return delta.get("text", "") if data.get("type") == "content_block_delta" else ""
        return "".join((c.get("delta") or {}).get("content") or "" for c in data.get("choices") or ())

    async def close(self) -> None:
        await self.http.aclose()


@dataclass(slots=True)
class Run:
    alone_ttft_s: float
    loaded_ttft_s: float
    longest_gap_s: float
    sub_tok_s: float
    aggregate_tok_s: float
    tokens: int


async def warm_turn(client: Client, name: str) -> list[dict[str, str]]:
    """The main agent's opening turn (cached after), then its warm turn: the second is measured."""
    messages = history(name)
    first = await client.turn(name, f"{name}-session", False, messages, MAIN_OUT)
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "Now explain the check() calls in two sentences, and say which "
                                             "ones could fail on an empty input."}]
    return messages


async def session(url: str, anthropic: bool, long_lines: int) -> Run:
    client = Client(url, anthropic)
    try:
        alone_messages = await warm_turn(client, "main-a")
        alone = await client.turn("main-a", "main-a-session", False, alone_messages, MAIN_OUT)
        loaded_messages = await warm_turn(client, "main-b")
        started = time.perf_counter()
        subs = [asyncio.create_task(client.turn(f"sub-{i}", "main-b-session", True, [
            {"role": "user", "content": f"Read module_{i}.py and list its functions:\n{lines(60, f'm{i}')}"}],
            SUB_OUT)) for i in range(SUBAGENTS)]
        long = asyncio.create_task(client.turn("sub-long", "main-b-session", True, [
            {"role": "user", "content": f"Review this whole file:\n{lines(long_lines, 'big')}"}], SUB_OUT))
        await asyncio.sleep(LOAD_HEAD_START_S)
        main = await client.turn("main-b", "main-b-session", False, loaded_messages, MAIN_OUT)
        done = await asyncio.gather(*subs, long)
        wall = time.perf_counter() - started
    finally:
        await client.close()
    sub_tokens = sum(len(s.pieces) for s in done)
    long_window = (done[-1].sent_at, done[-1].pieces[0] if done[-1].pieces else float("inf"))
    # The gaps of the subagents that decoded while the long prompt was prefilled.
    gaps = [max((b - a for a, b in zip(s.pieces, s.pieces[1:]) if a < long_window[1] and b > long_window[0]),
                default=0.0) for s in done[:-1]]
    return Run(alone.ttft_s, main.ttft_s, max(gaps, default=0.0), sub_tokens / wall,
               (sub_tokens + len(main.pieces)) / wall, sub_tokens + len(main.pieces))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per server (default: 2)")
    parser.add_argument("--servers", default="semantic,semantic-off,semantic-gap750,mlx_lm.server",
                        help="which servers to run, comma-separated (default: the four above; also "
                             "semantic-speculate-off)")
    args = parser.parse_args()
    long_lines = 60 if args.quick else 260
    folder = model_folder(args.model, args.cache_dir)
    result = BenchResult("bench_agent_priority", "The main agent's turn while subagents load the machine",
                         args={"model": args.model, "repeats": args.repeats, "subagents": SUBAGENTS,
                               "long_lines": long_lines, "quick": args.quick})
    wanted = args.servers.split(",")
    runs: dict[str, list[Run]] = {name: [] for name in wanted}
    with tempfile.TemporaryDirectory(prefix="bench-agent-priority-") as work:
        launches = {
            "semantic": semantic_launch(folder, Path(work) / "on", args.pool_mb, Batching()),
            "semantic-off": semantic_launch(folder, Path(work) / "off", args.pool_mb, Batching(),
                                            flags=("--no-priorities", "--decode-gap-ms", "0")),
            # The pacer's knob turned toward throughput: steps of up to 750 ms.
            "semantic-gap750": semantic_launch(folder, Path(work) / "gap750", args.pool_mb, Batching(),
                                               flags=("--decode-gap-ms", "750")),
            # Without speculative decoding: a reply's first tokens come one decode step each (with it, a reply
            # that copies its history can come several to a step), so the steps after the main turn's prefill
            # decide when its first word shows.
            "semantic-speculate-off": semantic_launch(folder, Path(work) / "nospec", args.pool_mb, Batching(),
                                                      flags=("--speculate", "off")),
            "mlx_lm.server": peer_defaults_launch(folder),
        }
        order = [launches[name] for name in wanted]
        for repeat in range(args.repeats):
            shift = repeat % len(order)
            for name, launch in zip(wanted[shift:] + wanted[:shift], order[shift:] + order[:shift]):
                print(f"# run {repeat + 1}/{args.repeats}, {name} ({load_average()})", flush=True)
                run = once(launch, Path(work), long_lines, name != "mlx_lm.server")
                runs[name].append(run)
                print(f"#   {name}: main TTFT alone {run.alone_ttft_s:.2f} s, loaded {run.loaded_ttft_s:.2f} s; "
                      f"longest subagent gap {run.longest_gap_s:.2f} s; subagents {run.sub_tok_s:.1f} tok/s; "
                      f"all {run.aggregate_tok_s:.1f} tok/s", flush=True)
    record(result, runs)
    result.write(args.json)


def once(launch: Launch, work: Path, long_lines: int, anthropic: bool) -> Run:
    with running(launch, work) as server:
        return asyncio.run(session(server.url, anthropic, long_lines))


def record(result: BenchResult, runs: dict[str, list[Run]]) -> None:
    def median(name: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in runs[name])

    for name in runs:
        group = f"{name}"
        result.metric(group, "main TTFT alone", median(name, "alone_ttft_s"), "s", "lower")
        result.metric(group, "main TTFT loaded", median(name, "loaded_ttft_s"), "s", "lower")
        ratios = [r.loaded_ttft_s / r.alone_ttft_s for r in runs[name]]
        result.metric(group, "main TTFT loaded / alone", statistics.median(ratios), "x", "lower",
                      target=1.5 if name in ("semantic", "semantic-speculate-off") else None)
        result.metric(group, "longest subagent gap during the long prefill", median(name, "longest_gap_s"), "s",
                      "lower", target=1.0 if name == "semantic" else None)
        result.metric(group, "subagents", median(name, "sub_tok_s"), "tok/s")
        result.metric(group, "all agents, loaded phase", median(name, "aggregate_tok_s"), "tok/s")
    for name in ("semantic", "semantic-gap750"):
        if name in runs and "semantic-off" in runs:
            result.comparisons.append(compare(f"{name}: loaded phase vs priorities off", "all agents' tok/s",
                                              "tok/s", [r.aggregate_tok_s for r in runs[name]],
                                              [r.aggregate_tok_s for r in runs["semantic-off"]], better="higher",
                                              target=0.95 if name == "semantic" else None))
    if "semantic" in runs and "mlx_lm.server" in runs:
        result.comparisons.append(compare("main warm turn under load", "TTFT", "s",
                                          [r.loaded_ttft_s for r in runs["semantic"]],
                                          [r.loaded_ttft_s for r in runs["mlx_lm.server"]]))
        result.comparisons.append(compare("subagents during the long prefill", "longest gap", "s",
                                          [r.longest_gap_s for r in runs["semantic"]],
                                          [r.longest_gap_s for r in runs["mlx_lm.server"]]))


if __name__ == "__main__":
    main()
