"""The floor under a new Claude Code session's first token, measured without any server.

``bench_claude_code_prefix.py`` targets a second session 10x faster than the
first. A new session shares the first one's prompt only up to its own user
text; everything after that point (the user's prompt and the ~1,500-token
``system`` message Claude Code puts after it) must be computed at ~18K tokens
of context, whatever the cache. This bench measures that work with plain
mlx-lm (its own KV caches, one process, no HTTP, no pool):

- ``full``: the whole rendered prompt, in chunks of the server's default
  prefill step (what a first session costs at best);
- ``rest``: only the tokens after the shared prefix, from a cache holding the
  prefix (what a later session costs at best), for several chunk sizes.

``full / rest`` is the most any server can show on this machine for the
issue-12 target.

Run: ``LD_PRELOAD=... python -m bench.bench_prefill_floor [--trace PATH] [--json PATH]``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from bench.common import base_parser, load
from bench.results import BenchResult

from bench.bench_claude_code_prefix import DEFAULT_TRACE, PROMPTS, main_request, session_body
from engine.api.anthropic_schemas import MessagesRequest
from engine.api.anthropic_translate import conversation_of
from engine.formats.rendering import PromptRenderer

SERVER_CHUNK = 512  # semantic's default --prefill-step-size
REST_CHUNKS = (256, 512, 1024, 2048)
BLOCK = 256


def rendered(renderer: PromptRenderer, body: dict) -> list[int]:
    return renderer.render(conversation_of(MessagesRequest.model_validate(body)))


def prefill(model: Any, cache: list, tokens: list[int], chunk: int) -> float:
    started = time.perf_counter()
    for i in range(0, len(tokens), chunk):
        model(mx.array([tokens[i:i + chunk]]), cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - started


def snapshot(cache: list) -> list[dict]:
    # ``a[:]`` is a new array object over the same data: writes to a copy never reach the snapshot.
    return [{k: (v[:] if isinstance(v, mx.array) else v) for k, v in c.__dict__.items()} for c in cache]


def restored(cache: list, saved: list[dict]) -> list:
    out = []
    for c, fields in zip(cache, saved):
        fresh = type(c).__new__(type(c))
        fresh.__dict__.update({k: (v[:] if isinstance(v, mx.array) else v) for k, v in fields.items()})
        out.append(fresh)
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="recorded Claude Code requests (JSONL)")
    parser.set_defaults(model="gemma3-270m")
    args = parser.parse_args()
    loaded = load(args)
    renderer = PromptRenderer(loaded.tokenizer)
    base = main_request(args.trace)
    first, second = (rendered(renderer, session_body(base, p)) for p in PROMPTS[:2])
    common = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    shared = common // BLOCK * BLOCK  # the server shares whole blocks
    rest = second[shared:-1]  # the last prompt token is the first decode step's input
    print(f"# prompt {len(second)} tokens, differs from another session's at {common}; "
          f"{shared} shared (whole blocks), {len(rest)} to compute")
    result = BenchResult("bench_prefill_floor", "A new session's prefill floor (plain mlx-lm, no server)",
                         args={"model": args.model, "trace": str(args.trace), "prompt_tokens": len(second),
                               "shared_tokens": shared, "rest_tokens": len(rest)})
    started = time.perf_counter()
    model = loaded.model

    cache = make_prompt_cache(model)
    prefix_s = prefill(model, cache, second[:shared], SERVER_CHUNK)
    saved = snapshot(cache)
    rest_s = {}
    for chunk in REST_CHUNKS:
        rest_s[chunk] = prefill(model, restored(cache, saved), rest, chunk)
        print(f"# rest: {len(rest)} tokens after {shared} cached, chunks of {chunk:4d}: {rest_s[chunk]:6.2f} s",
              flush=True)
        result.metric("rest of the prompt", f"chunks of {chunk}", rest_s[chunk], "s", better="lower")
    full_s = prefix_s + rest_s[SERVER_CHUNK]
    print(f"# full: {len(second) - 1} tokens in chunks of {SERVER_CHUNK}: {full_s:6.2f} s "
          f"(prefix {prefix_s:.2f} s + rest {rest_s[SERVER_CHUNK]:.2f} s)")
    result.metric("whole prompt", f"chunks of {SERVER_CHUNK}", full_s, "s", better="lower")
    best = min(rest_s.values())
    bound = full_s / best
    print(f"most a server could show: {bound:.1f}x (whole prompt / best rest; target of issue 12: 10x)")
    result.metric("upper bound of the speed-up", "whole prompt / best rest", bound, "x", better="higher")
    result.duration_s = time.perf_counter() - started
    result.write(args.json)


if __name__ == "__main__":
    main()
