"""Where one engine step's time goes, at batch 1, 4 and 16 (SmolLM2 unless --model), next to mlx-lm's BatchGenerator.

The engine's named steps are timed from outside (wrappers installed by this
script, nothing in the engine changes): per decode step,

- graph: building the forward pass and the sampler (Python, MLX graph
  construction; the ragged batch's per-sequence attention included). On the
  CPU a Llama-family decode step runs whole on the host
  (``backends/cpu/host_forward.py``), and other models' batches evaluate each
  layer inside the model call (``host_decode.py``, ``host_linear.py``),
  so there this holds the whole forward and "device" only what follows it;
- device: evaluating it (``mx.async_eval`` of the step, which on the CPU
  backend computes before it returns, plus the wait when the tokens are
  read: the arithmetic itself, memory traffic and MLX's per-operation cost);
- prefill: the prompts' prefill chunks, spread over the decode steps;
- bookkeeping: the step's plan and the room granted for it (``SequenceBatch.plan``,
  ``StepRoom.grant``: pool blocks and cache capacity), checkpoints and paying for them;
- text: detokenization and stop-string checks (``scheduler/stepping.py``: ``Stepping._decode``);
- delivery: handing events to sinks (``scheduler/delivery.py``: ``Delivery.emit``);
- other: the rest of the engine loop around the step.

On the CPU each batch also runs on an engine whose CPU backend sends the
decode step through MLX's forward (``CpuOptions(host_step=False,
linear_pass=False)``: the engine before those paths), in the same run, so the
report shows what they change.

mlx-lm's ``BatchGenerator.next()`` (what mlx_lm.server runs) is timed the same
way where it can be: its whole step, and its detokenization as the server does
it per token. The split decides what to optimize; the report keeps it so a
regression shows.

Run: ``LD_PRELOAD=... python -m bench.bench_step_profile [--tokens N] [--json PATH]``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from bench.common import base_parser, load, print_table, render_chat, start_engine
from bench.results import BenchResult, recorded

from engine.runtime.runner import batch as batch_module
from engine.runtime.scheduler.delivery import Delivery
from engine.runtime.scheduler.scheduler import Scheduler
from engine.runtime.scheduler.step_room import StepRoom
from engine.runtime.scheduler.stepping import Stepping
from engine.domain.requests import GenerationRequest, SamplingParams
from engine.runtime.engine_thread.sync_client import run_turns

BATCHES = (1, 4, 16)
PARTS = ("prefill", "graph", "device", "bookkeeping", "text", "delivery", "other")
TOPICS = ["the sea", "a robot", "a forest", "trains", "the moon", "a cat", "rain", "chess"]


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0

    def wrap(self, owner: Any, name: str, label: str) -> Callable[[], None]:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


class _TimedMx:
    """The generator module's ``mx`` with ``async_eval`` timed (the step's evaluation)."""

    def __init__(self, timers: Timers) -> None:
        self._timers = timers

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def async_eval(self, *arrays: Any) -> None:
        started = time.perf_counter()
        try:
            mx.async_eval(*arrays)
        finally:
            self._timers.seconds["eval"] += time.perf_counter() - started


@contextmanager
def engine_timers() -> Iterator[Timers]:
    """Times the engine's steps: the whole scheduler step, and the parts named in the module docstring."""
    timers = Timers()
    batch = batch_module.SequenceBatch
    batch_module.mx = _TimedMx(timers)  # type: ignore[assignment]
    undo = [
        timers.wrap(Scheduler, "step", "step"),
        timers.wrap(batch, "_prefill", "prefill"),
        timers.wrap(batch, "_forward", "graph"),
        timers.wrap(batch_module, "_sample", "graph"),
        timers.wrap(batch, "plan", "bookkeeping"),
        timers.wrap(StepRoom, "grant", "bookkeeping"),
        timers.wrap(StepRoom, "pay_checkpoints", "bookkeeping"),
        timers.wrap(batch, "checkpoint_prompt_ends", "bookkeeping"),
        timers.wrap(batch, "_collect", "collect"),
        timers.wrap(Stepping, "_decode", "text"),
        timers.wrap(Delivery, "emit", "delivery"),
    ]
    try:
        yield timers
    finally:
        for restore in undo:
            restore()
        batch_module.mx = mx

def prompts(loaded, n: int) -> list[tuple[int, ...]]:
    return [render_chat(loaded, [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}, "
                                                            f"part {i}."}]) for i in range(n)]


# What a request without a temperature gets from the server (engine/models/sampling_defaults.py's fallback).
DEFAULT_SAMPLING = SamplingParams(temperature=0.7, top_p=0.95, top_k=40, seed=0)


def through_mlx_forward() -> Any:
    """A CPU backend whose decode steps go through MLX's forward (no host step, no linear pass); None off the
    CPU (Metal, CUDA: there is nothing to compare)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return None
    from engine.runtime.runner.backends.cpu.backend import CpuBackend, CpuOptions

    return CpuBackend(CpuOptions(host_step=False, linear_pass=False))


def engine_profile(engine, loaded, batch: int, tokens: int, sampling: SamplingParams = SamplingParams(),
                   tag: str = "g") -> dict[str, float]:
    requests = [GenerationRequest(f"p{tag}{batch}-{i}", p, tokens, sampling=sampling, stop_strings=("\n\n\n",))
                for i, p in enumerate(prompts(loaded, batch))]
    with engine_timers() as timers:
        started = time.perf_counter()
        results = run_turns(engine, requests, timeout_s=1800)
        wall = time.perf_counter() - started
    steps = max(r.finish.usage.generated_tokens for r in results)
    s = timers.seconds
    # Collecting a step's tokens waits for the device to finish it: that wait is the arithmetic.
    split = {
        "graph": s["graph"], "device": s["eval"] + s["collect"],
        "bookkeeping": s["bookkeeping"], "text": s["text"], "delivery": s["delivery"],
        "prefill": s["prefill"],
    }
    split["other"] = max(0.0, wall - sum(split.values()))
    per_step = {k: 1000 * v / steps for k, v in split.items()}
    per_step["tok/s"] = sum(r.finish.usage.generated_tokens for r in results) / wall
    return per_step


def batchgenerator_profile(loaded, batch: int, tokens: int) -> dict[str, float]:
    """mlx-lm's BatchGenerator on the same prompts: its whole step, and the server's per-token detokenizing."""
    generator = BatchGenerator(loaded.model, stop_tokens=[[t] for t in loaded.eos_token_ids],
                               completion_batch_size=batch, prefill_batch_size=batch, prefill_step_size=512,
                               stream=mx.default_stream(mx.default_device()))
    generator.insert([list(p) for p in prompts(loaded, batch)], max_tokens=[tokens] * batch)
    detokenizers = {}
    step_s = text_s = 0.0
    steps = generated = 0
    started = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        _, responses = generator.next()
        t1 = time.perf_counter()
        for r in responses:
            d = detokenizers.setdefault(r.uid, loaded.tokenizer.detokenizer)
            d.add_token(r.token)
            _ = d.last_segment
        t2 = time.perf_counter()
        if responses:
            steps += 1
            generated += len(responses)
            step_s += t1 - t0
            text_s += t2 - t1
        if not responses and not len(generator._unprocessed_sequences) and not len(generator._prompt_batch) \
                and not len(generator._generation_batch):
            break
    wall = time.perf_counter() - started
    generator.close()
    return {"step (forward, sample, sync)": 1000 * step_s / steps, "text": 1000 * text_s / steps,
            "tok/s": generated / wall}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    args = parser.parse_args()
    tokens = 24 if args.quick else args.tokens
    result = BenchResult("bench_step_profile", "Where a decode step's time goes (engine vs BatchGenerator)",
                         {"model": args.model, "tokens": tokens, "batches": list(BATCHES)})
    with recorded(result, args.json):
        loaded = load(args)
        ours, sampled = profile_engine(loaded, args.pool_mb, tokens)
        compared = through_mlx_forward()
        mlx_forward = profile_engine(loaded, args.pool_mb, tokens, compared)[0] if compared is not None else {}
        rows = []
        for batch in BATCHES:
            peer = batchgenerator_profile(loaded, batch, tokens)
            mine = ours[batch]
            rows.append([batch, *(f"{mine[k]:.1f}" for k in PARTS),
                         f"{mine['tok/s']:.1f}", f"{peer['step (forward, sample, sync)']:.1f}",
                         f"{peer['text']:.1f}", f"{peer['tok/s']:.1f}"])
            if batch in mlx_forward:
                other = mlx_forward[batch]
                rows.append([f"{batch}, MLX forward", *(f"{other[k]:.1f}" for k in PARTS),
                             f"{other['tok/s']:.1f}", "", "", ""])
                result.metric("decode throughput", f"engine through MLX's forward, batch {batch}", other["tok/s"],
                              "tok/s")
            for key in PARTS:
                result.metric(f"engine step at batch {batch} (ms per step)", key, mine[key], "ms", better="lower")
            result.metric("decode throughput", f"engine, batch {batch}", mine["tok/s"], "tok/s")
            result.metric("decode throughput", f"BatchGenerator, batch {batch}", peer["tok/s"], "tok/s")
            result.metric(f"BatchGenerator step at batch {batch} (ms per step)", "forward, sample, sync",
                          peer["step (forward, sample, sync)"], "ms", better="lower")
            result.metric(f"BatchGenerator step at batch {batch} (ms per step)", "text", peer["text"], "ms",
                          better="lower")
        assert sampled is not None
        rows.append(["16 sampled", *(f"{sampled[k]:.1f}" for k in PARTS), f"{sampled['tok/s']:.1f}", "", "", ""])
        for key in PARTS:
            result.metric("engine step at batch 16, default sampling (ms per step)", key, sampled[key], "ms",
                          better="lower")
        result.metric("decode throughput", "engine, batch 16, default sampling", sampled["tok/s"], "tok/s")
        print_table(["batch", "prefill ms", "graph ms", "device ms", "bookkeeping ms", "text ms", "delivery ms",
                     "other ms", "engine tok/s", "BG step ms", "BG text ms", "BG tok/s"], rows)


def profile_engine(loaded, pool_mb: float, tokens: int, backend: Any = None
                   ) -> tuple[dict[int, dict[str, float]], dict[str, float] | None]:
    """Every batch's split on one engine (``backend``: one to compare, else the device's), and for the default
    backend the sampled batch-16 split."""
    compare = backend is not None
    engine = start_engine(loaded, pool_mb, backend=backend)
    try:
        # Warm-ups, greedy and sampled: a backend that compiles kernels on first use (CUDA) would
        # otherwise bill that to the first measured steps (an H100 run once showed 215 ms sampled steps).
        engine_profile(engine, loaded, 1, 8)
        engine_profile(engine, loaded, 16, 8, DEFAULT_SAMPLING, tag="w")
        splits = {batch: engine_profile(engine, loaded, batch, tokens, tag="m" if compare else "g")
                  for batch in BATCHES}
        sampled = None if compare else engine_profile(engine, loaded, 16, tokens, DEFAULT_SAMPLING, tag="s")
        return splits, sampled
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
