"""Two resident models on one device: does a small model's decoding go on while a larger one prefills?

The server holds ``--large`` (the default model) and ``--model`` as an extra
model (``--extra-model small=...``), as ``semantic --serve`` does. An agent of
the small model decodes a long reply; while it does, an agent of the large
model sends a long prompt. Measured, for the small agent: its decode rate
alone, and while the large prompt prefills, with the engines taking turns on
the device (what the server does: a step each, first come first served,
engine_thread/device_turns.py: the one that has held the device least goes
next) and, for comparison, with both engines computing at once (turns off); the longest gap between two of its tokens;
and how long the large prompt's prefill took in each case. Turns on and off
alternate, ``--rounds`` each.

Run: ``LD_PRELOAD=... python -m bench.bench_resident_models [--quick] [--json PATH]``.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import base_parser, print_table
from bench.results import BenchResult, recorded

from engine.api.service import EngineService
from engine.bootstrap import start_engine
from engine.domain.requests import FinishEvent, GenerationRequest, TokenEvent
from engine.runtime.engine_thread.engine import Engine
from engine.settings import Settings

STORY = "Tell me a long story about a lighthouse keeper who collects clocks, with many details."
FILLER = "The quick brown fox jumps over the lazy dog near the quiet river bank. "


@dataclass
class Turn:
    """One submitted turn's token arrival times."""

    times: list[float] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    finished_at: float = 0.0

    def sink(self, event: Any) -> None:
        now = time.perf_counter()
        if isinstance(event, TokenEvent):
            self.times.append(now)
        elif isinstance(event, FinishEvent):
            self.finished_at = now
            self.done.set()


def submit(engine: Engine, agent: str, tokens: list[int], max_tokens: int) -> Turn:
    turn = Turn()
    engine.submit(GenerationRequest(agent, tuple(tokens), max_tokens, model_id=engine.loaded.identity.key),
                  turn.sink)
    return turn


def rate_between(times: list[float], start: float, end: float) -> tuple[float, float]:
    """Tokens per second of the arrivals inside [start, end], and the longest gap there (s)."""
    inside = [t for t in times if start <= t <= end]
    if len(inside) < 2:
        return 0.0, end - start
    gaps = [b - a for a, b in zip(inside, inside[1:])]
    return (len(inside) - 1) / (inside[-1] - inside[0]), max(gaps)


def one_round(small: Engine, large: Engine, story: list[int], long_prompt: list[int], reply: int, tag: str,
              turns_on: bool, shared: Any) -> dict[str, float]:
    small.device_turns = large.device_turns = shared if turns_on else None
    turns_before = dict(shared.turns)
    waited_before = dict(shared.waited_s)
    decoding = submit(small, f"small-{tag}", story, reply)
    while len(decoding.times) < 8:  # decoding steadily before the large prompt arrives
        time.sleep(0.005)
    started = time.perf_counter()
    prefill = submit(large, f"large-{tag}", long_prompt, 1)
    prefill.done.wait(600)
    decoding.done.wait(600)
    end = min(prefill.finished_at, decoding.times[-1])
    rate, gap = rate_between(decoding.times, started, end)
    before = decoding.times[: 8]
    alone = (len(before) - 1) / (before[-1] - before[0])
    name = large.loaded.model_id
    return {"during_tok_s": rate, "max_gap_s": gap, "prefill_s": prefill.finished_at - started,
            "alone_tok_s": alone, "overlap_s": end - started,
            "large_turns": shared.turns.get(name, 0) - turns_before.get(name, 0),
            "large_waited_s": shared.waited_s.get(name, 0.0) - waited_before.get(name, 0.0)}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--large", default="gemma3-270m", help="the default model, which prefills (default: gemma3-270m)")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="the large model's prompt (default 4096)")
    parser.add_argument("--reply", type=int, default=512, help="the small agent's reply budget (default 512)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds with turns on and off each, alternating")
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens, args.reply, args.rounds = 1024, 192, 1
    settings = Settings(model=args.large, cache_dir=args.cache_dir, extra_models=(f"small={args.model}",),
                        pool_budget_mb=args.pool_mb, api_key=None, speculate="off", persist_on_exit=False)
    result = BenchResult("resident_models", "Two resident models: the small one's decoding while the large one "
                         "prefills", vars(args) | {"cache_dir": None, "json": None})
    with recorded(result, args.json):
        large = start_engine(settings)
        service = EngineService(settings, large)
        service.serve_extra_models(large)
        small = service.models.engine_for("small")
        shared = large.device_turns
        story = small.loaded.tokenizer.apply_chat_template([{"role": "user", "content": STORY}],
                                                           add_generation_prompt=True)
        filler = large.loaded.tokenizer.encode(FILLER * (args.prompt_tokens // 12 + 1))[: args.prompt_tokens]
        rows: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
        try:
            for k, mode in enumerate(("on", "off")):  # warm-up: first prefills and decodes load and allocate
                one_round(small, large, story, [filler[-1 - k], filler[-3 - k], *filler], args.reply,
                          f"warm-{mode}", mode == "on", shared)
            for index in range(args.rounds):
                order = ("on", "off") if index % 2 == 0 else ("off", "on")
                for mode in order:
                    # A new large prompt each time (its first tokens differ): no prefix to reuse.
                    prompt = [*filler[2 * index + (mode == "on"): 2 * index + (mode == "on") + 2][::-1], *filler]
                    row = one_round(small, large, story, prompt, args.reply, f"{mode}{index}", mode == "on", shared)
                    rows[mode].append(row)
                    print(f"# round {index} turns {mode}: {row}", flush=True)
        finally:
            service.models.stop_all()
            large.stop(0.0)
        table = []
        for mode, label in (("on", "turns (the server)"), ("off", "no turns (both at once)")):
            median = {key: statistics.median(r[key] for r in rows[mode]) for key in rows[mode][0]}
            table.append([label, f"{median['alone_tok_s']:.1f}", f"{median['during_tok_s']:.1f}",
                          f"{median['max_gap_s']:.2f}", f"{median['prefill_s']:.2f}"])
            group = f"small model decode while the large one prefills {args.prompt_tokens} tokens"
            result.metric(group, f"{label}: small decode alone", median["alone_tok_s"], "tok/s")
            result.metric(group, f"{label}: small decode during the prefill", median["during_tok_s"], "tok/s")
            result.metric(group, f"{label}: longest gap between its tokens", median["max_gap_s"], "s", "lower")
            result.metric(group, f"{label}: the large prefill", median["prefill_s"], "s", "lower")
        print_table(["device", "small alone tok/s", "small during tok/s", "longest gap s", "large prefill s"], table)
        result.notes.append(f"{args.model} as the small extra model, {args.large} as the default model; medians of "
                            f"{args.rounds} round(s) each, turns on and off alternating; greedy; speculation off.")


if __name__ == "__main__":
    main()
