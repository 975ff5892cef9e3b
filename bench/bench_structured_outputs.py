"""Structured outputs (JSON schema constrained decoding) on a served model: validity and cost in the batch.

Two measurements against ``semantic --serve`` on one model folder, through the OpenAI chat API with the
official SDK, as a client sends ``response_format``:

- validity: ``--requests`` requests (default 50) over ten schemas of ``tests/support/json_schemas.py``
  (``--schemas bounded``: SCHEMAS, strings and arrays bounded; ``open``: OPEN_SCHEMAS, unbounded, where small
  models loop), eight at a time, at each ``--sampling`` (the model's own defaults, no temperature sent; or
  greedy): how many finished, whether every finished reply parses and validates with ``jsonschema`` (the
  target: all of them), how many ran to ``max_tokens``, and how many semantic closed from a loop
  (``usage.semantic.loop_closed``). ``--closing both`` asks the same of a server started with
  ``--no-close-constrained-loops`` first: the before and after of closing loops inside the grammar. The same requests
  go to ``mlx_lm.server`` (``--peer``; its batching set equal to semantic's, as in the throughput
  comparison: a tuned peer, not its defaults), which has no constrained decoding: how many of its
  replies happen to validate.
- cost in the batch: eight agents at once, each asked for a long story (``workload_text.story_request``,
  a reply that runs to ``max_tokens``), greedy: all eight free, then four of them constrained to a JSON
  array of integers that cannot close before ``max_tokens`` (the other four free, the same prompts). The measure is decode throughput: completion
  tokens over the time from the first token to the last (prefill left out: the same prompts both ways).
  Each request names its agent (``session_id``): without it, requests that share their first message's
  head are one agent's turns, served one after another.
  The target: the mixed batch at least 0.8x the free one. The two configurations alternate, ``--repeats``
  times each (0: skip).
- strict tool calls (``--tool-calls N``): N requests, each offering one strict tool whose parameters are one
  of the ten schemas, with ``tool_choice: "required"`` and ``parallel_tool_calls: false``: how many end with a
  tool call whose arguments validate (the target: all). The peer's row (``--peer``) is the same requests to
  ``mlx_lm.server``.

Run: ``LD_PRELOAD=... python -m bench.bench_structured_outputs [--model M] [--requests 50] [--repeats 3]
[--tool-calls 20] [--schemas open] [--sampling greedy,default] [--closing both] [--peer] [--json PATH]``.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import jsonschema
import openai

from bench.common import base_parser, print_table
from bench.results import BenchResult, compare, recorded
from bench.served import Batching, peer_launch, semantic_launch, serving
from bench.workload_text import story_request

from bench.bench_vs_mlx_lm_server import model_folder

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests.support.json_schemas import OPEN_SCHEMAS, SCHEMAS  # noqa: E402

AGENTS = 8
# The name both servers answer with the model they were started on (mlx_lm.server loads any other name).
MODEL = "default_model"
CONSTRAINED = 4
# A list of numbers that cannot close before max_tokens (what keeps every constrained row decoding).
COUNTING_SCHEMA = {"type": "object", "properties": {"numbers": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100000}, "minItems": 1000}},
    "required": ["numbers"], "additionalProperties": False}


_runs = itertools.count()
# What the batch runs ask each agent for: a reply that runs to max_tokens when free. A chat model writes a
# long story; a base model (Gemma 3 270M, plain format) ends a story in a line, but writes numbers on and on.
BATCH_PROMPTS: dict[str, Callable[[int], list[dict[str, str]]]] = {
    "story": lambda i: story_request(AGENTS, i),
    "numbers": lambda i: [{"role": "user", "content": f"Write the numbers from {100 * (i + 1)} to "
                                                      f"{100 * (i + 3)} in words, one per line."}],
}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="any", base_url=f"{url}/v1", max_retries=0, timeout=900)


def validity(url: str, requests: int, max_tokens: int, schemas: list = SCHEMAS,
             temperature: float | None = None) -> dict[str, Any]:
    """``requests`` schema-constrained requests, eight at a time: finished, valid, truncated, invalid, and how many
    semantic closed from a loop (``usage.semantic.loop_closed``). ``temperature`` None: the model's defaults."""
    gpt = client(url)

    def one(i: int) -> tuple[str, str, bool, bool, str]:
        key, prompt, schema = schemas[i % len(schemas)]
        sampling = {} if temperature is None else {"temperature": temperature}
        response = gpt.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            extra_body={"session_id": f"schema-{next(_runs)}"},  # one agent each (the peer ignores it)
            response_format={"type": "json_schema", "json_schema": {"name": key, "schema": schema, "strict": True}},
            **sampling)
        choice = response.choices[0]
        try:
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        return key, choice.finish_reason, valid, _loop_closed(response), (choice.message.content or "")[-160:]

    rows, seconds = _eight_at_a_time(one, requests)
    finished = [r for r in rows if r[1] == "stop"]
    return {"requests": requests, "finished": len(finished), "finished_valid": sum(r[2] for r in finished),
            "truncated": sum(r[1] == "length" for r in rows), "valid_any": sum(r[2] for r in rows),
            "loop_closed": sum(r[3] is not None for r in rows),
            "closed_at_limit": sum(r[3] == "token_limit" for r in rows), "seconds": seconds,
            "invalid_finished": [r[0] for r in finished if not r[2]],
            "truncated_schemas": [r[0] for r in rows if r[1] == "length"],
            "truncated_tails": [f"{r[0]}: ...{r[4]}" for r in rows if r[1] == "length"]}


def tool_calls(url: str, requests: int, max_tokens: int, schemas: list = SCHEMAS,
               temperature: float | None = None) -> dict[str, Any]:
    """``requests`` forced calls of one strict tool each (parameters: the schemas in turn), eight at a time:
    how many came back as one call whose arguments validate."""
    gpt = client(url)

    def one(i: int) -> tuple[str, str, bool, bool]:
        key, prompt, schema = schemas[i % len(schemas)]
        tool = {"type": "function", "function": {"name": f"record_{key}", "description": f"Record a {key}.",
                                                 "parameters": schema, "strict": True}}
        sampling = {} if temperature is None else {"temperature": temperature}
        response = gpt.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt.replace("as JSON", "with the tool")}],
            max_tokens=max_tokens, tools=[tool], tool_choice="required", parallel_tool_calls=False,
            extra_body={"session_id": f"tool-{next(_runs)}"}, **sampling)
        choice = response.choices[0]
        calls = choice.message.tool_calls or []
        try:
            valid = len(calls) == 1 and calls[0].function.name == f"record_{key}"
            if valid:
                jsonschema.validate(json.loads(calls[0].function.arguments), schema)
        except (ValueError, jsonschema.ValidationError):
            valid = False
        return key, choice.finish_reason, valid, _loop_closed(response)

    rows, seconds = _eight_at_a_time(one, requests)
    return {"requests": requests, "tool_calls": sum(r[1] == "tool_calls" for r in rows),
            "valid_calls": sum(r[2] for r in rows), "truncated": sum(r[1] == "length" for r in rows),
            "loop_closed": sum(r[3] is not None for r in rows),
            "closed_at_limit": sum(r[3] == "token_limit" for r in rows), "seconds": seconds,
            "invalid": [r[0] for r in rows if not r[2]]}


def _loop_closed(response: Any) -> str | None:
    """Why semantic steered the reply closed (its usage extension's ``loop_closed.kind``: "loop", or
    "token_limit" when max_tokens was about to cut it); None when it did not (and for the peer, which has none)."""
    usage = response.usage.model_extra if response.usage is not None else None
    closed = ((usage or {}).get("semantic") or {}).get("loop_closed")
    return (closed.get("kind") or "loop") if closed else None


def _eight_at_a_time(one: Callable[[int], Any], requests: int) -> tuple[list[Any], float]:
    """``one(i)`` for every request, AGENTS at a time: the rows in order, and the seconds it all took."""
    started = time.perf_counter()
    with ThreadPoolExecutor(AGENTS) as pool:
        rows = list(pool.map(one, range(requests)))
    return rows, round(time.perf_counter() - started, 1)


def batch_rate(url: str, constrained: int, max_tokens: int, prompt: str = "story") -> tuple[float, list[int]]:
    """Eight story agents at once, ``constrained`` of them held to COUNTING_SCHEMA: decode tokens/second. New
    agents each run (every run starts from the same state: the prompt's first turn)."""
    gpt = client(url)
    tag = next(_runs)

    def one(i: int) -> tuple[float, float, int]:
        extra: dict[str, Any] = {}
        if i < constrained:
            extra["response_format"] = {"type": "json_schema",
                                        "json_schema": {"name": "numbers", "schema": COUNTING_SCHEMA}}
        stream = gpt.chat.completions.create(
            model=MODEL, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            messages=BATCH_PROMPTS[prompt](i), extra_body={"session_id": f"batch-{tag}-{i}"}, **extra)
        first = None
        tokens = 0
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first or time.perf_counter(), time.perf_counter(), tokens

    with ThreadPoolExecutor(AGENTS) as pool:
        rows = list(pool.map(one, range(AGENTS)))
    window = max(r[1] for r in rows) - min(r[0] for r in rows)
    counts = [r[2] for r in rows]
    return sum(counts) / window, counts


SAMPLINGS = {"greedy": 0.0, "default": None}  # None: the model's own defaults (no temperature sent)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, help="schema requests for validity (default 50; quick 10; 0: skip)")
    parser.add_argument("--repeats", type=int, help="runs of each batch configuration (default 3; quick 1; "
                                                    "0: skip the batch runs)")
    parser.add_argument("--tool-calls", type=int, default=0, help="forced strict tool-call requests (default 0: "
                                                                  "skip)")
    parser.add_argument("--batch-tokens", type=int, default=128, help="tokens each agent generates in the batch "
                                                                      "runs (default 128)")
    parser.add_argument("--max-tokens", type=int, default=200, help="max_tokens of the validity requests")
    parser.add_argument("--schemas", choices=["bounded", "open"], default="bounded",
                        help="bounded: tests/support/json_schemas.py SCHEMAS (maxLength, maxItems); open: "
                             "OPEN_SCHEMAS (unbounded strings and arrays, where small models loop)")
    parser.add_argument("--sampling", default="default",
                        help="comma-separated: greedy (temperature 0), default (the model's own sampling); "
                             "each runs the validity and tool-call requests (default: default)")
    parser.add_argument("--closing", choices=["on", "off", "both"], default="on",
                        help="semantic's close_constrained_loops: on (its default), off, or both (off first, "
                             "then on, the same requests: the before and after)")
    parser.add_argument("--peer", action="store_true", help="also send the validity requests to mlx_lm.server")
    parser.add_argument("--batch-prompt", choices=sorted(BATCH_PROMPTS), default="story",
                        help="what each agent of the batch runs is asked for: story (a chat model) or numbers "
                             "(a base model, which ends a story in a line)")
    args = parser.parse_args()
    requests = args.requests if args.requests is not None else (10 if args.quick else 50)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    samplings = [name.strip() for name in args.sampling.split(",") if name.strip()]
    if unknown := [name for name in samplings if name not in SAMPLINGS]:
        parser.error(f"--sampling: unknown {', '.join(unknown)} (choose from {', '.join(SAMPLINGS)})")
    schemas = OPEN_SCHEMAS if args.schemas == "open" else SCHEMAS
    closings = ["off", "on"] if args.closing == "both" else [args.closing]
    folder = model_folder(args.model, args.cache_dir)
    result = BenchResult("bench_structured_outputs", "Structured outputs: validity and cost in the batch",
                         args={"model": args.model, "requests": requests, "repeats": repeats,
                               "batch_tokens": args.batch_tokens, "batch_prompt": args.batch_prompt,
                               "max_tokens": args.max_tokens, "tool_calls": args.tool_calls,
                               "schemas": args.schemas, "sampling": samplings, "closing": closings,
                               "agents": AGENTS, "constrained": CONSTRAINED, "quick": args.quick})
    table: list[list[Any]] = []
    free_rates: list[float] = []
    mixed_rates: list[float] = []
    with recorded(result, args.json), tempfile.TemporaryDirectory() as scratch:
        logs = Path(scratch)
        batching = Batching(decode=16)
        for closing in closings:
            flags = () if closing == "on" else ("--no-close-constrained-loops",)
            with serving(semantic_launch(folder, logs / f"state-{closing}", args.pool_mb, batching, flags=flags),
                         logs) as url:
                _ask_all(result, table, url, f"semantic, closing {closing}", samplings, schemas, requests, args)
                if closing == closings[-1]:
                    _batch_runs(result, url, repeats, args, free_rates, mixed_rates)
        if args.peer and (requests or args.tool_calls):
            with serving(peer_launch(folder, batching, cache_entries=10), logs) as url:
                _ask_all(result, table, url, "mlx_lm.server", samplings, schemas, requests, args)
        if mixed_rates:
            result.comparisons.append(compare("batch of 8, 4 constrained", "decode throughput vs all free", "tok/s",
                                              mixed_rates, free_rates, better="higher", target=0.8))
    ratios = [m / f for m, f in zip(mixed_rates, free_rates)]
    if table:
        print_table(["server, closing, sampling", "requests", "stop and valid", "ran to the cap",
                     "closed (loops, limit)", "tool calls valid", "tool calls at the cap", "tool loops closed"],
                    table)
    if mixed_rates:
        print_table(["measure", "value"], [
            ["free batch tok/s (median)", f"{statistics.median(free_rates):.1f}"],
            ["4 constrained tok/s (median)", f"{statistics.median(mixed_rates):.1f}"],
            ["ratio per repeat", ", ".join(f"{r:.2f}" for r in ratios)]])


def _ask_all(result: BenchResult, table: list[list[Any]], url: str, server: str, samplings: list[str],
             schemas: list, requests: int, args: Any) -> None:
    """The validity and tool-call requests at each sampling, against one running server."""
    for sampling in samplings:
        label = f"{server}, {sampling}"
        temperature = SAMPLINGS[sampling]
        ours = validity(url, requests, args.max_tokens, schemas, temperature) if requests else None
        tools = tool_calls(url, args.tool_calls, args.max_tokens, schemas, temperature) if args.tool_calls else None
        print(f"# {label} validity: {ours}\n# {label} strict tool calls: {tools}")
        _record(result, table, label, ours, tools)


def _record(result: BenchResult, table: list[list[Any]], label: str, ours: dict[str, Any] | None,
            tools: dict[str, Any] | None) -> None:
    """One server configuration's validity and tool-call results: metrics, notes and a table row."""
    if ours is not None:
        result.metric("validity", f"{label}: finished replies that validate", ours["finished_valid"], "replies")
        result.metric("validity", f"{label}: ran to max_tokens", ours["truncated"], "replies", better="lower")
        result.metric("validity", f"{label}: loops closed", ours["loop_closed"], "replies")
        result.metric("validity", f"{label}: of them closed before max_tokens", ours["closed_at_limit"], "replies")
        result.notes.append(f"{label} validity: {json.dumps(ours)}")
    if tools is not None:
        result.metric("tool calls", f"{label}: forced strict calls that validate", tools["valid_calls"], "calls")
        result.metric("tool calls", f"{label}: ran to max_tokens", tools["truncated"], "calls", better="lower")
        result.notes.append(f"{label} strict tool calls: {json.dumps(tools)}")
    table.append([label,
                  ours["requests"] if ours else "-",
                  ours["finished_valid"] if ours else "-", ours["truncated"] if ours else "-",
                  f"{ours['loop_closed']} ({ours['closed_at_limit']} at the limit)" if ours else "-",
                  f"{tools['valid_calls']} of {tools['requests']}" if tools else "-",
                  tools["truncated"] if tools else "-",
                  f"{tools['loop_closed']} ({tools['closed_at_limit']} at the limit)" if tools else "-"])


def _batch_runs(result: BenchResult, url: str, repeats: int, args: Any, free_rates: list[float],
                mixed_rates: list[float]) -> None:
    """The batch of eight, all free and four constrained, alternating, ``repeats`` times each."""
    for repeat in range(repeats):
        order = [0, CONSTRAINED] if repeat % 2 == 0 else [CONSTRAINED, 0]
        for constrained in order:
            rate, counts = batch_rate(url, constrained, args.batch_tokens, args.batch_prompt)
            (mixed_rates if constrained else free_rates).append(rate)
            print(f"# batch of {AGENTS}, {constrained} constrained: {rate:.1f} tok/s, tokens {counts}")
            if min(counts) < args.batch_tokens:
                result.notes.append(f"repeat {repeat}, {constrained} constrained: an agent ended early "
                                    f"({counts}); the rate counts the tokens it made")


if __name__ == "__main__":
    main()
