"""Replay recorded client traffic against semantic, any Anthropic- or OpenAI-compatible server, or both.

Record a trace with ``semantic --serve --record-requests trace.jsonl`` (or
``bench/record_claude_code.py``), then:

    python -m bench.replay TRACE --url http://127.0.0.1:8000          # one running server
    python -m bench.replay TRACE --url URL --protocol openai          # an OpenAI-only server
    python -m bench.replay TRACE --compare [--model M] [--json PATH]  # semantic vs mlx_lm.server

Each session (Claude Code's session id header, semantic's agent header, the
body's ``session_id`` or ``metadata.user_id``) replays its requests in
order, one at a time, as the client did: a request waits for the answer to
the one before, then for the pause the client took after it. Sessions start
at their recorded offsets, so sessions that overlapped overlap again.
Untimed traces replay back to back.

Requests go out as recorded except that ``max_tokens`` is capped
(``--max-tokens``, default 128): a replay measures how the server meets the
prompts, and a local model's answers differ from the recorded ones anyway.
For an OpenAI-only server (mlx_lm.server) Anthropic bodies are translated:
system first, tool definitions as functions, tool calls and results as
OpenAI messages.

Per turn it reports TTFT (first output delta; the whole answer when not
streamed), prompt tokens, tokens the server reports reading from its cache,
and errors. ``--compare`` starts ``semantic --serve`` and ``mlx_lm.server``
on the same model folder, one at a time, alternating which goes first per
repeat, and writes per-turn TTFT ratios (mlx_lm.server / semantic) into a
BenchResult for ``bench/report.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import base_parser
from bench.peer_runs import load_average
from bench.results import BenchResult, compare
from bench.served import Batching, Launch, peer_defaults_launch, peer_launch, running, semantic_launch
from bench.trace_format import Recorded, TraceError, load_trace, sessions, to_openai

DEFAULT_TRACE = Path(__file__).parent / "traces" / "claude_code_bare.jsonl"
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True, slots=True)
class ReplayTurn:
    """What one replayed request met."""

    session: str  # s1, s2... in order of first appearance in the trace
    turn: int  # 0-based index within its session
    line: int  # the trace line it came from
    status: int  # HTTP status; 0 when no response came
    ttft_s: float  # to the first output delta (the whole answer when not streamed)
    total_s: float
    prompt_tokens: int
    reused_tokens: int  # what the server says it read from its cache
    output_tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


# -- one request -----------------------------------------------------------------------------------


def outgoing(request: Recorded, protocol: str, max_tokens: int, api_key: str) -> tuple[str, dict[str, str], dict]:
    """Path, headers and body to send for ``request`` to a server that speaks ``protocol``."""
    translate = protocol == "openai" and request.protocol != "openai"
    body = to_openai(request.body, request.protocol) if translate else dict(request.body)
    if protocol == "responses":
        body["max_output_tokens"] = min(int(body.get("max_output_tokens") or max_tokens), max_tokens)
        headers = {**request.headers, "authorization": f"Bearer {api_key}"}
        return request.path, headers, body
    body["max_tokens"] = min(int(body.get("max_tokens") or max_tokens), max_tokens)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled" \
            and int(thinking.get("budget_tokens") or 0) >= body["max_tokens"]:
        # Claude Code asks for 31,999 of its 32,000 tokens; the budget must stay below the capped max_tokens.
        body["thinking"] = {**thinking, "budget_tokens": body["max_tokens"] - 1}
    if protocol == "openai":
        body.pop("max_completion_tokens", None)
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
        headers = {"content-type": "application/json", "authorization": f"Bearer {api_key}"}
        return "/v1/chat/completions", headers, body
    return request.path, {**request.headers, "x-api-key": api_key}, body


async def send(client: httpx.AsyncClient, request: Recorded, session: str, turn: int, protocol: str,
               max_tokens: int, api_key: str) -> ReplayTurn:
    path, headers, body = outgoing(request, protocol, max_tokens, api_key)
    reading = _Reading(time.perf_counter())
    status = 0
    try:
        async with client.stream("POST", path, json=body, headers=headers) as response:
            status = response.status_code
            if status != 200:
                text = (await response.aread()).decode(errors="replace")
                reading.error = f"HTTP {status}: {text[:300]}"
            elif body.get("stream"):
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        reading.event(json.loads(line[6:]), protocol)
            else:
                reading.whole(json.loads(await response.aread()))
    except (httpx.HTTPError, ValueError) as exc:
        reading.error = f"{type(exc).__name__}: {exc}"
    done = time.perf_counter()
    return ReplayTurn(session, turn, request.line, status, (reading.first_at or done) - reading.sent_at,
                      done - reading.sent_at, *reading.tokens(protocol), reading.error)


@dataclass(slots=True)
class _Reading:
    sent_at: float
    first_at: float | None = None
    error: str | None = None
    usage: dict[str, Any] | None = None

    def event(self, event: dict[str, Any], protocol: str) -> None:
        if protocol == "anthropic":
            kind = event.get("type")
            if kind == "message_start":
                self.usage = dict(event["message"].get("usage") or {})
            elif kind in ("content_block_delta", "message_delta"):
                self.first_at = self.first_at or time.perf_counter()
                if kind == "message_delta":
                    self.usage = {**(self.usage or {}), **(event.get("usage") or {})}
            elif kind == "error":
                self.error = f"stream error: {event.get('error')}"
            return
        if protocol == "responses":
            kind = event.get("type", "")
            if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
                self.first_at = self.first_at or time.perf_counter()
            elif kind in ("response.completed", "response.incomplete"):
                self.usage = event["response"].get("usage")
            elif kind in ("response.failed", "error"):
                self.error = f"stream error: {event.get('response', {}).get('error') or event.get('message')}"
            return
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                self.first_at = self.first_at or time.perf_counter()

    def whole(self, answer: dict[str, Any]) -> None:
        self.first_at = time.perf_counter()
        self.usage = answer.get("usage")

    def tokens(self, protocol: str) -> tuple[int, int, int]:
        return usage_tokens(self.usage or {}, protocol)


def usage_tokens(usage: dict[str, Any], protocol: str) -> tuple[int, int, int]:
    """(prompt, reused, output) from a server's own usage report in ``protocol``'s shape."""
    if protocol == "anthropic":
        reused = int(usage.get("cache_read_input_tokens") or 0)
        prompt = int(usage.get("input_tokens") or 0) + reused + int(usage.get("cache_creation_input_tokens") or 0)
        return prompt, reused, int(usage.get("output_tokens") or 0)
    if protocol == "responses":
        details = usage.get("input_tokens_details") or {}
        return (int(usage.get("input_tokens") or 0), int(details.get("cached_tokens") or 0),
                int(usage.get("output_tokens") or 0))
    details = usage.get("prompt_tokens_details") or {}
    return (int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0),
            int(usage.get("completion_tokens") or 0))


# -- a whole trace -----------------------------------------------------------------------------------


def schedule(requests: list[Recorded]) -> dict[str, tuple[float, list[tuple[Recorded, float]]]]:
    """Per session label: its start offset, and each request with the pause the client took before it."""
    origin = min((r.t for r in requests if r.t is not None), default=0.0)
    plan = {}
    for number, group in enumerate(sessions(requests).values(), start=1):
        start = (group[0].t - origin) if group[0].t is not None else 0.0
        steps = [(group[0], 0.0)]
        for before, request in zip(group, group[1:]):
            steps.append((request, recorded_pause(before, request)))
        plan[f"s{number}"] = (start, steps)
    return plan


def recorded_pause(before: Recorded, request: Recorded) -> float:
    """The time between the client getting ``before``'s answer and sending ``request`` (0 when untimed)."""
    if before.t is None or request.t is None or before.duration_s is None:
        return 0.0
    return max(0.0, request.t - (before.t + before.duration_s))


async def replay(url: str, requests: list[Recorded], protocol: str = "anthropic",
                 max_tokens: int = DEFAULT_MAX_TOKENS, pause_scale: float = 1.0, api_key: str = "replay",
                 verbose: bool = True) -> list[ReplayTurn]:
    """Replay ``requests`` against ``url``; the turns in the order they were sent."""
    plan = schedule(requests)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        async def play(label: str, start: float, steps: list[tuple[Recorded, float]]) -> list[ReplayTurn]:
            await asyncio.sleep(start * pause_scale)
            turns = []
            for index, (request, pause) in enumerate(steps):
                await asyncio.sleep(pause * pause_scale)
                turn = await send(client, request, label, index, protocol, max_tokens, api_key)
                if verbose:
                    print(describe(turn), flush=True)
                turns.append(turn)
            return turns

        groups = await asyncio.gather(*(play(label, start, steps) for label, (start, steps) in plan.items()))
    return [turn for group in groups for turn in group]


def describe(turn: ReplayTurn) -> str:
    outcome = "ok" if turn.ok else turn.error
    return (f"#   {turn.session:>4} turn {turn.turn:2d}  prompt {turn.prompt_tokens:6d}  from cache "
            f"{turn.reused_tokens:6d}  TTFT {turn.ttft_s:8.2f} s  total {turn.total_s:8.2f} s  {outcome}")


def detect_protocol(requests: list[Recorded]) -> str:
    """The trace's own protocol (a trace holds one client's traffic)."""
    for protocol in ("anthropic", "responses"):
        if any(r.protocol == protocol for r in requests):
            return protocol
    return "openai"


# -- semantic vs mlx_lm.server ------------------------------------------------------------------------


def run_compare(requests: list[Recorded], folder: Path, args: argparse.Namespace) -> BenchResult:
    result = BenchResult("bench_replay", f"Replayed trace {args.trace.name}: semantic vs mlx_lm.server",
                         args={"trace": str(args.trace), "model": args.model, "requests": len(requests),
                               "max_tokens": args.max_tokens, "repeats": args.repeats,
                               "pause_scale": args.pause_scale, "peer": args.peer})
    protocol = detect_protocol(requests)
    runs: dict[str, list[list[ReplayTurn]]] = {"semantic": [], "mlx_lm.server": []}
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as work:
        peer_server = (peer_defaults_launch(folder) if args.peer == "defaults"
                       else peer_launch(folder, Batching(), cache_entries=10))
        launches = (semantic_launch(folder, Path(work) / "state", args.pool_mb, Batching()), peer_server)
        for repeat in range(args.repeats):
            for launch in launches if repeat % 2 == 0 else launches[::-1]:
                print(f"# run {repeat + 1}/{args.repeats}, {launch.name} ({load_average()})", flush=True)
                runs[launch.name].append(_replay_on(launch, Path(work), requests,
                                                    protocol if launch.name == "semantic" else "openai", args))
    ours, theirs = runs["semantic"], runs["mlx_lm.server"]
    for key in sorted({(t.session, t.turn) for t in ours[0]}, key=lambda k: (int(k[0][1:]), k[1])):
        mine, peer = _at(ours, key), _at(theirs, key)
        if all(t.ok for t in mine + peer):
            result.comparisons.append(compare(f"{key[0]} turn {key[1]}", "TTFT", "s", [t.ttft_s for t in mine],
                                              [t.ttft_s for t in peer]))
    result.comparisons.append(compare("whole trace", "sum of TTFT", "s", [_ttft_sum(r) for r in ours],
                                      [_ttft_sum(r) for r in theirs]))
    for name, repeats in runs.items():
        last = repeats[-1]
        result.metric(name, "errors", sum(not t.ok for r in repeats for t in r), "requests", better="lower")
        result.metric(name, "prompt tokens read from cache", 100 * _reused_share(last), "%")
        result.notes += [f"{name}: {describe(t).lstrip('# ')}" for t in last if not t.ok]
    result.notes.append(f"max_tokens capped at {args.max_tokens}; mlx_lm.server got the Anthropic bodies "
                        "translated to OpenAI chat (bench/trace_format.py).")
    return result


def _replay_on(launch: Launch, work: Path, requests: list[Recorded], protocol: str,
               args: argparse.Namespace) -> list[ReplayTurn]:
    with running(launch, work) as server:
        t0 = time.perf_counter()
        turns = asyncio.run(replay(server.url, requests, protocol, args.max_tokens, args.pause_scale))
        print(f"#   done in {time.perf_counter() - t0:.0f} s, {sum(not t.ok for t in turns)} errors", flush=True)
        return turns


def _at(runs: list[list[ReplayTurn]], key: tuple[str, int]) -> list[ReplayTurn]:
    return [t for run in runs for t in run if (t.session, t.turn) == key]


def _ttft_sum(turns: list[ReplayTurn]) -> float:
    return sum(t.ttft_s for t in turns if t.ok)


def _reused_share(turns: list[ReplayTurn]) -> float:
    prompt = sum(t.prompt_tokens for t in turns)
    return sum(t.reused_tokens for t in turns) / prompt if prompt else 0.0


# -- command line -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__.splitlines()[0])
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("trace", type=Path, nargs="?", default=DEFAULT_TRACE,
                        help=f"JSONL trace (default: {DEFAULT_TRACE.relative_to(DEFAULT_TRACE.parents[2])})")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", help="replay against this running server")
    target.add_argument("--compare", action="store_true",
                        help="start semantic and mlx_lm.server on --model and replay on both, alternating")
    parser.add_argument("--protocol", choices=("auto", "anthropic", "responses", "openai"), default="auto",
                        help="what the --url server speaks (auto: the trace's own protocol)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"cap on every request's max_tokens (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--pause-scale", type=float, default=1.0,
                        help="multiply recorded start offsets and pauses (0: back to back; default 1)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per server with --compare (default 2)")
    parser.add_argument("--peer", choices=("defaults", "tuned"), default="defaults",
                        help="with --compare: `mlx_lm.server --model FOLDER` as users run it (defaults, the "
                             "default), or with its batching set equal to semantic's and a 10-entry prompt cache "
                             "(tuned)")
    parser.add_argument("--api-key", default="replay", help="key sent to the server (default: 'replay')")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        requests = load_trace(args.trace)
    except (OSError, TraceError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print(f"replay: {args.trace} holds no generation requests", file=sys.stderr)
        return 2
    print(f"# {args.trace}: {len(requests)} requests in {len(sessions(requests))} sessions")
    started = time.perf_counter()
    if args.compare:
        from bench.bench_vs_mlx_lm_server import model_folder

        result = run_compare(requests, model_folder(args.model, args.cache_dir), args)
        for c in result.comparisons:
            print(f"{c.workload:>12}: TTFT semantic {c.semantic.median:7.2f} s, mlx_lm.server {c.peer.median:7.2f} s, "
                  f"ratio {c.advantage.median:5.2f}x")
    else:
        url = args.url or "http://127.0.0.1:8000"
        protocol = detect_protocol(requests) if args.protocol == "auto" else args.protocol
        turns = asyncio.run(replay(url, requests, protocol, args.max_tokens, args.pause_scale, args.api_key))
        result = BenchResult("bench_replay", f"Replayed trace {args.trace.name} against {url}",
                             args={"trace": str(args.trace), "url": url, "protocol": protocol,
                                   "max_tokens": args.max_tokens})
        for turn in turns:
            label = f"{turn.session} turn {turn.turn}"
            result.metric("time to first token", label, turn.ttft_s, "s", better="lower")
            result.metric("prompt tokens read from cache", label, turn.reused_tokens, "tok", better="neither")
        result.metric("whole trace", "errors", sum(not t.ok for t in turns), "requests", better="lower")
        ttfts = [t.ttft_s for t in turns if t.ok]
        if ttfts:
            print(f"# {len(turns)} turns, {len(turns) - len(ttfts)} errors, TTFT median {statistics.median(ttfts):.2f} s")
        result.notes += [json.dumps(asdict(t)) for t in turns if not t.ok]
    result.duration_s = time.perf_counter() - started
    result.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
