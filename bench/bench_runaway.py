"""Runaway answers: how the server's defaults end a small model's loops, measured on Claude Code's own request.

The request is ``bench/traces/claude_code_continue_runaway.jsonl``: Claude
Code's ``claude --bare --continue -p "Name another."`` as recorded from the
real CLI, after a first answer in which SmolLM2 began a numbered list. This
is the request that once made the end-to-end test time out: sampled answers
continue the list (``# 7.3\\nThis is a minor detail...\\n\\n# 7.4\\n...``) until
the output cap, minutes on a CPU.

Two parts:

1. **Served answers.** For each sampling configuration, ``semantic --serve``
   (its defaults otherwise: output cap, repetition guard) answers the request
   ``--samples`` times at once, each as its own Claude Code session, then
   ``--sequential`` more one at a time, as a user's single ``claude -p`` meets
   it. Per answer: tokens, how it ended (the model's end of turn, the
   repetition guard, the cap) from ``/v1/stats``; per sequential answer its
   wall time.
2. **False positives.** The guard, exactly as the engine runs it
   (``engine.domain.repetition.RepetitionGuard``), reads the first
   ``--corpus-tokens`` tokens of every source and documentation file in this
   repository and in the installed mlx-lm, Textual, Rich, httpx, FastAPI and
   pydantic packages: legitimate text a model may be asked to write (tables,
   boilerplate). It must end none of them. The highest near-loop similarity
   (share of a window's tokens equal to the token a cycle back) is reported,
   against the guard's threshold.

Run: ``LD_PRELOAD=... python -m bench.bench_runaway [--quick] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import numpy as np

from bench.common import ROOT, base_parser
from bench.results import BenchResult, recorded
from bench.served import Batching, running, semantic_launch

from engine.settings import Settings
from engine.domain.repetition import MAX_PERIOD, SIMILARITY, RepetitionGuard

TRACE = Path(__file__).parent / "traces" / "claude_code_continue_runaway.jsonl"
# (name, extra server flags): the server's defaults, and the generic fallback sampling for comparison.
CONFIGS = (
    ("defaults", ()),
    ("temperature 0.7", ("--default-temperature", "0.7", "--default-top-p", "0.95", "--default-top-k", "40")),
)
CORPUS_PACKAGES = ("mlx_lm", "textual", "rich", "httpx", "fastapi", "pydantic")


@dataclass(frozen=True, slots=True)
class Answer:
    tokens: int
    ended_by: str  # "end of turn", "repetition guard", "output cap", other finish reasons as the engine names them
    seconds: float


def load_request(path: Path) -> tuple[dict, dict]:
    """The last main request of the trace (the --continue turn): its body and protocol headers."""
    line = json.loads(path.read_text().splitlines()[-1])
    body = dict(line["body"], stream=False)
    headers = {k: v for k, v in line["headers"].items() if k.startswith("anthropic")}
    return body, headers


async def ask(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> tuple[str, int, float]:
    session = str(uuid.uuid4())
    started = time.perf_counter()
    response = await client.post(f"{url}/v1/messages?beta=true", json=body, timeout=3600,
                                 headers={**headers, "x-claude-code-session-id": session, "x-api-key": "bench"})
    response.raise_for_status()
    return session, response.json()["usage"]["output_tokens"], time.perf_counter() - started


def finishes(url: str) -> dict[str, str]:
    """Claude Code session id -> how its agent's last turn ended."""
    agents = httpx.get(f"{url}/v1/stats", timeout=30).json()["agents"]
    names = {"stop": "end of turn", "repetition": "repetition guard", "length": "output cap"}
    return {a["agent_id"]: names.get(a.get("last_finish") or "", a.get("last_finish") or "?") for a in agents}


def ended_by(session: str, by_agent: dict[str, str]) -> str:
    return next((how for agent, how in by_agent.items() if session in agent), "?")


async def serve_answers(url: str, body: dict, headers: dict, samples: int, sequential: int) -> list[Answer]:
    async with httpx.AsyncClient() as client:
        together = await asyncio.gather(*[ask(client, url, body, headers) for _ in range(samples)])
        alone = [await ask(client, url, body, headers) for _ in range(sequential)]
    by_agent = finishes(url)
    return [Answer(tokens, ended_by(session, by_agent), seconds if i >= samples else float("nan"))
            for i, (session, tokens, seconds) in enumerate([*together, *alone])]


def corpus_files() -> list[Path]:
    files = sorted([*ROOT.glob("engine/**/*.py"), *ROOT.glob("semantic_tui/**/*.py"), *ROOT.glob("bench/*.py"),
                    *ROOT.glob("tests/**/*.py"), *ROOT.glob("*.md")])
    for name in CORPUS_PACKAGES:
        module = sys.modules.get(name) or __import__(name)
        package = Path(module.__file__).parent
        files += sorted([*package.glob("*.py"), *package.glob("*/*.py")])
    return files


def similarity(tokens: list[int], window: int) -> float:
    """Highest share, over every window and period up to MAX_PERIOD, of tokens equal to the token a cycle back."""
    ids = np.asarray(tokens)
    best = 0.0
    for period in range(1, MAX_PERIOD + 1):
        if len(ids) < window + period:
            break
        same = (ids[period:] == ids[:-period]).astype(np.int32)
        best = max(best, float(np.convolve(same, np.ones(window, dtype=np.int32), "valid").max()) / window)
    return best


def false_positives(tokenizer, window: int, limit: int) -> tuple[int, int, float, str]:
    """(files read, files the guard would end, highest similarity, its file)."""
    fired, best, best_file, read = 0, 0.0, "", 0
    for path in corpus_files():
        tokens = tokenizer.encode(path.read_text(errors="ignore"))[:limit]
        if len(tokens) < window:
            continue
        read += 1
        guard = RepetitionGuard(window)
        fired += any(guard.push(t) is not None for t in tokens)
        if (value := similarity(tokens, window)) > best:
            best, best_file = value, str(path.relative_to(path.parents[1]))
    return read, fired, best, best_file


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, help="answers served at once per configuration (default 16, quick 4)")
    parser.add_argument("--sequential", type=int, help="answers served one at a time (default 3, quick 1)")
    parser.add_argument("--corpus-tokens", type=int, default=8000, help="tokens read from each corpus file")
    parser.add_argument("--trace", type=Path, default=TRACE, help="recorded request (its last line is asked)")
    args = parser.parse_args()
    samples = args.samples or (4 if args.quick else 16)
    sequential = args.sequential if args.sequential is not None else (1 if args.quick else 3)
    from bench.bench_vs_mlx_lm_server import model_folder

    folder = model_folder(args.model, args.cache_dir)
    body, headers = load_request(args.trace)
    result = BenchResult("runaway", "Runaway answers to Claude Code's recorded --continue request",
                         args={"model": args.model, "samples": samples, "sequential": sequential,
                               "trace": args.trace.name, "quick": args.quick})
    with recorded(result, args.json), tempfile.TemporaryDirectory() as work:
        window = Settings.model_fields["repetition_window"].default
        for name, flags in CONFIGS:
            launch = semantic_launch(folder, Path(work) / name, args.pool_mb, Batching())
            launch = replace(launch, argv=launch.argv + flags)
            with running(launch, Path(work)) as server:
                sampling = httpx.get(f"{server.url}/v1/stats", timeout=30).json()["model"]["sampling_defaults"]
                result.notes.append(f"{name}: requests without a temperature sample with {sampling}.")
                print(f"\n# {name}: {sampling}")
                answers = asyncio.run(serve_answers(server.url, body, headers, samples, sequential))
            report_config(result, name, answers)
        read, fired, best, best_file = false_positives(tokenizer_of(folder), window, args.corpus_tokens)
        print(f"\n# false positives: the guard (window {window}) ended {fired} of {read} corpus files; "
              f"highest similarity {best:.3f} ({best_file}), threshold {SIMILARITY}")
        result.metric("false positives", "corpus files read", read, "files", "neither")
        result.metric("false positives", "files the guard would end", fired, "files", "lower", target=0)
        result.metric("false positives", "highest near-loop similarity", best, "share", "lower", target=SIMILARITY)
        result.notes.append(f"Highest similarity in {best_file}.")


def report_config(result: BenchResult, name: str, answers: list[Answer]) -> None:
    print(f"\n# {name}: {len(answers)} answers")
    for i, a in enumerate(answers):
        alone = f"{a.seconds:.1f} s alone" if a.seconds == a.seconds else "served together"
        print(f"  {i:2d}  {a.tokens:5d} tokens  {a.ended_by:17s} {alone}")
    group = f"answers ({name})"
    for how in ("end of turn", "repetition guard", "output cap"):
        result.metric(group, f"ended by {how}", sum(a.ended_by == how for a in answers), "answers", "neither")
    tokens = [a.tokens for a in answers]
    result.metric(group, "tokens, median", float(np.median(tokens)), "tokens", "lower")
    result.metric(group, "tokens, max", max(tokens), "tokens", "lower")
    timed = [a.seconds for a in answers if a.seconds == a.seconds]
    if timed:
        result.metric(group, "seconds alone, max", max(timed), "s", "lower", target=120.0)


def tokenizer_of(folder: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(folder)


if __name__ == "__main__":
    main()
