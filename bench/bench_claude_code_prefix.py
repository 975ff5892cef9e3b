"""Full-size Claude Code requests on Gemma 3: how fast does a new session start?

Replays the first request a real Claude Code CLI sent without ``--bare``
(recorded by ``bench/record_claude_code.py``: ~12-15K tokens of system prompt
and tool definitions) as new sessions, each with its own session id and its
own prompt, against ``semantic --serve``:

1. the first session ever (it computes the shared prefix);
2. a second session while the first is still in memory;
3. a third after every agent was evicted to disk;
4. a fourth after the server was stopped (SIGTERM) and started again.

Time to first token is taken at the first text delta of the stream (the
stream is then closed: the rest of the reply is not what is measured).
Target (issue 12): sessions 2-4 at least 10x faster than the first.

Run: ``LD_PRELOAD=... python -m bench.bench_claude_code_prefix [--trace PATH] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import base_parser
from bench.results import BenchResult
from bench.served import Batching, running, semantic_launch

from bench.bench_vs_mlx_lm_server import model_folder

DEFAULT_TRACE = Path(__file__).parent / "traces" / "claude_code_full.jsonl"
TARGET = 10.0
PROMPTS = ["Name one colour.", "List the files here.", "What does this project do?", "Say hello."]


@dataclass(frozen=True, slots=True)
class Start:
    label: str
    ttft_s: float
    prompt_tokens: int
    reused_tokens: int


def main_request(trace: Path) -> dict:
    """The biggest streamed /v1/messages body of the trace: the conversation's own first turn."""
    bodies = [r["body"] for r in map(json.loads, trace.read_text().splitlines())
              if r["path"].startswith("/v1/messages") and "count_tokens" not in r["path"] and r.get("body")]
    return max((b for b in bodies if b.get("stream")), key=lambda b: len(json.dumps(b)))


def session_body(base: dict, prompt: str) -> dict:
    """The recorded request with another user prompt in its last text block, as a new session would send."""
    body = copy.deepcopy(base)
    message = [m for m in body["messages"] if m["role"] == "user"][-1]
    if isinstance(message["content"], str):
        message["content"] = prompt
    else:
        texts = [b for b in message["content"] if b.get("type") == "text"]
        texts[-1]["text"] = prompt
    return body


async def start_session(url: str, body: dict, label: str) -> Start:
    headers = {"x-claude-code-session-id": str(uuid.uuid4()), "anthropic-version": "2023-06-01",
               "x-api-key": "any", "content-type": "application/json"}
    usage: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800, connect=30)) as client:
        sent = time.perf_counter()
        async with client.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "message_start":
                    usage = event["message"]["usage"]
                if event["type"] == "content_block_delta" or event["type"] == "message_delta":
                    break
        ttft = time.perf_counter() - sent
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    start = Start(label, ttft, prompt, usage["cache_read_input_tokens"])
    print(f"# {label:<32} TTFT {ttft:8.2f} s  prompt {prompt:6d}  read from cache {start.reused_tokens:6d}",
          flush=True)
    return start


def run(folder: Path, base: dict, work: Path, pool_mb: float) -> list[Start]:
    launch = semantic_launch(folder, work / "state", pool_mb, Batching(), persist=True)
    starts = []
    with running(launch, work) as server:
        starts.append(asyncio.run(start_session(server.url, session_body(base, PROMPTS[0]), "first session")))
        starts.append(asyncio.run(start_session(server.url, session_body(base, PROMPTS[1]),
                                                "second session (first in memory)")))
        httpx.post(f"{server.url}/v1/admin/evict-idle", json={"tier": "warm"}, timeout=300).raise_for_status()
        starts.append(asyncio.run(start_session(server.url, session_body(base, PROMPTS[2]),
                                                "new session (all agents on disk)")))
    with running(launch, work, keep_state=True) as server:
        starts.append(asyncio.run(start_session(server.url, session_body(base, PROMPTS[3]),
                                                "new session (after a restart)")))
    return starts


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="recorded Claude Code requests (JSONL)")
    parser.set_defaults(model="gemma3-270m")
    args = parser.parse_args()
    folder = model_folder(args.model, args.cache_dir)
    base = main_request(args.trace)
    result = BenchResult("bench_claude_code_prefix", "Full-size Claude Code sessions: time to the first token",
                         args={"model": args.model, "trace": str(args.trace), "request_bytes": len(json.dumps(base))})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-cc-prefix-") as work:
        starts = run(folder, base, Path(work), args.pool_mb)
    first = starts[0]
    for start in starts:
        result.metric("time to first token", start.label, start.ttft_s, "s", better="lower")
        result.metric("prompt tokens read from cache", start.label, start.reused_tokens, "tok", better="neither")
    for start in starts[1:]:
        speedup = first.ttft_s / max(start.ttft_s, 1e-9)
        result.metric("speed-up over the first session", start.label, speedup, "x", target=TARGET)
        print(f"{start.label}: {speedup:.1f}x faster than the first session (target {TARGET:g}x: "
              f"{'met' if speedup >= TARGET else 'MISSED'})")
    result.duration_s = time.perf_counter() - started
    result.write(args.json)


if __name__ == "__main__":
    main()
