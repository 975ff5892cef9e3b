"""semantic vs mlx_vlm.server on a vision-language model: the same folder, the same workloads, in the same run.

1. screenshots   one agent, four turns: a screenshot and a question, a follow-up, a second screenshot and a
                 question, a follow-up; every turn resends the whole history, images included, as chat
                 clients do. Warm turns are turns 2-4.
2. shared_image  eight agents at once, each sending one shared image with its own question, then a
                 follow-up each (the warm turn).

The model folder is a random-weight Gemma 3 (bench/vision_model.py, size BENCH: Gemma 3 270M's text
shape, a SigLIP-B-like tower over 448-pixel images, 256 soft tokens an image), or with ``--family qwen3_5``
a random-weight Qwen3.5 (size QWEN3_5_BENCH: its gated-delta and attention layers at about that scale,
multi-axis rotary positions, a ViT-B-wide tower, a screenshot 22x14 tokens), so the same weights load in
both servers; replies run to ``max_tokens`` on both (a random model writes no end token). Both servers run
as subprocesses on a loopback port, one at a time, order alternating per repeat; mlx_vlm.server at its
defaults (``python -m mlx_vlm.server --model FOLDER``: its vision-feature cache and continuous batching
on, its automatic prefix cache off, as it ships) or with that prefix cache on (``--peer apc``:
``APC_ENABLED=1``, its block cache with image hashes and its SSD tier), semantic at its defaults with the
``session_id`` extension. Metrics are min/median/
max per server and of the per-repeat ratio ("semantic advantage": above 1 means semantic did better).
Targets (issue 54): warm-turn TTFT and wall time >= 1.5x on both workloads, no turn below 1.0x.

Run: ``LD_PRELOAD=... python -m bench.bench_vision [--quick] [--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.chat_stream import ChatClient, Turn
from bench.common import base_parser
from bench.comparison import mean_ttft, paired, print_comparisons
from bench.peer_runs import Outcome, on_both, served_once
from bench.results import BenchResult
from bench.served import Batching, Launch, semantic_launch
from bench.vision_model import BENCH, QWEN3_5_BENCH, QWEN_VL_TINY, TINY, gemma3_vlm, qwen_vl_vlm

from engine.models.loader import resolve_model
from engine.settings import default_cache_dir


@dataclass(frozen=True, slots=True)
class Sizes:
    reply_tokens: int
    agents: int  # shared_image
    repeats: int


FULL = Sizes(reply_tokens=32, agents=8, repeats=3)
QUICK = Sizes(reply_tokens=8, agents=4, repeats=1)


def screenshot(seed: int, width: int = 1280, height: int = 800) -> bytes:
    """A synthetic screenshot: a window title bar, a sidebar, panes and lines of 'text' (bars), as PNG."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (246, 246, 248))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, 36), fill=(60, 64, 72))
    draw.rectangle((0, 36, 240, height), fill=(232, 234, 240))
    for row in range(60, height - 20, 22):
        draw.rectangle((260, row, 260 + rng.randint(200, 900), row + 10), fill=(rng.randint(40, 120),) * 3)
        if row % 66 == 60:
            draw.rectangle((20, row, 20 + rng.randint(80, 190), row + 10), fill=(90, 110, rng.randint(140, 220)))
    draw.rectangle((width - 220, height - 70, width - 40, height - 30), fill=(30, 120, 220))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(data).decode()}"}}


def user(text: str, image: bytes | None = None) -> dict[str, Any]:
    return {"role": "user", "content": [*([image_part(image)] if image else []), {"type": "text", "text": text}]}


@dataclass(frozen=True, slots=True)
class Bench:
    folder: Path
    work_dir: Path
    sizes: Sizes
    result: BenchResult
    peer_apc: bool = False  # mlx_vlm.server with its automatic prefix cache on (off at its defaults)

    def launches(self, workload: str) -> tuple[Launch, Launch]:
        ours = semantic_launch(self.folder, self.work_dir / f"semantic-{workload}", 2048, Batching())
        ours = replace(ours, model_field=str(self.folder))
        # Its SSD tier goes under the run's work dir, emptied with it: no run inherits another's cache.
        env = (("APC_ENABLED", "1"), ("MLX_VLM_CACHE_HOME", str(self.work_dir / f"peer-apc-{workload}"))) \
            if self.peer_apc else ()
        peer = Launch("mlx_vlm.server", (sys.executable, "-m", "mlx_vlm.server", "--model", str(self.folder)),
                      None, sends_session_id=False, model_field=str(self.folder), env=env)
        return ours, peer


# -- 1. screenshots -----------------------------------------------------------------------------------
SCRIPT = [("What does this screen show?", 1), ("Which button would save the file?", None),
          ("And this second screen: what changed?", 2), ("Summarise both screens in one line.", None)]


def screenshots(bench: Bench) -> None:
    s = bench.sizes
    print(f"\n## screenshots: one agent, {len(SCRIPT)} turns, two 1280x800 screenshots, {s.reply_tokens}-token replies")
    shots = {seed: screenshot(seed) for seed in (1, 2)}

    async def work(client: ChatClient) -> Outcome:
        messages: list[dict[str, Any]] = []
        turns = []
        t0 = time.perf_counter()
        for index, (text, seed) in enumerate(SCRIPT):
            messages.append(user(text, shots[seed] if seed else None))
            turn = await client.turn("screens", index, messages, s.reply_tokens)
            messages.append({"role": "assistant", "content": turn.text})
            turns.append(turn)
        return Outcome(turns, time.perf_counter() - t0)

    ours, theirs = on_both(bench.launches("screenshots"), s.repeats,
                           lambda launch: served_once(launch, bench.work_dir, work))
    _compare(bench, "screenshots", ours, theirs, warm_from=1)


# -- 2. shared_image -----------------------------------------------------------------------------------
def shared_image(bench: Bench) -> None:
    s = bench.sizes
    print(f"\n## shared_image: {s.agents} agents at once, one shared screenshot, own question, then a follow-up; "
          f"{s.reply_tokens}-token replies")
    shot = screenshot(3)

    async def agent(client: ChatClient, n: int) -> list[Turn]:
        messages = [user(f"I am agent {n}. What should agent {n} click first on this screen?", shot)]
        first = await retried(client, f"agent-{n}", 0, messages, s.reply_tokens)
        messages += [{"role": "assistant", "content": first.text}, user(f"Agent {n}: and after that?")]
        return [first, await retried(client, f"agent-{n}", 1, messages, s.reply_tokens)]

    async def work(client: ChatClient) -> Outcome:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(agent(client, n) for n in range(s.agents)))
        return Outcome([t for run in runs for t in run], time.perf_counter() - t0)

    ours, theirs = on_both(bench.launches("shared_image"), s.repeats,
                           lambda launch: served_once(launch, bench.work_dir, work))
    _compare(bench, "shared_image", ours, theirs, warm_from=1)


FAILED_TURNS: dict[str, int] = {}
RETRIES = 20


async def retried(client: ChatClient, agent: str, index: int, messages: list[dict[str, Any]], max_tokens: int) -> Turn:
    """A turn sent again when the server answers it with an error, as a client would: the wait counts in its TTFT,
    and each error is tallied for the report (mlx_vlm.server 0.7.10 fails a batch of image prompts of unequal
    lengths with a concatenate error in the stream)."""
    sent_at = time.perf_counter()
    for attempt in range(RETRIES + 1):
        try:
            turn = await client.turn(agent, index, messages, max_tokens)
            return replace(turn, sent_at=sent_at, retries=turn.retries + attempt)
        except RuntimeError as exc:
            if attempt == RETRIES or "server error in stream" not in str(exc):
                raise
            FAILED_TURNS[str(exc)[:160]] = FAILED_TURNS.get(str(exc)[:160], 0) + 1
            # Spread out, so a batch that failed is not sent again as the same batch.
            await asyncio.sleep(min(3.0, random.uniform(0.2, 1.0) * (attempt + 1)))
    raise AssertionError("unreachable")


def _compare(bench: Bench, workload: str, ours: list[Outcome], theirs: list[Outcome], warm_from: int) -> None:
    first = len(bench.result.comparisons)
    paired(bench.result, workload, "wall time", "s", lambda o: o.wall_s, ours, theirs, target=1.5)
    paired(bench.result, workload, "warm-turn TTFT (mean)", "s", lambda o: mean_ttft(o.from_turn(warm_from)),
           ours, theirs, target=1.5)
    n_turns = max(t.index for t in ours[0].turns) + 1
    for index in range(n_turns):
        paired(bench.result, workload, f"turn {index + 1} TTFT (mean)", "s",
               lambda o, i=index: mean_ttft(o.turns_at(i)), ours, theirs, target=1.0)
    print_comparisons(bench.result.comparisons[first:], "mlx_vlm.server")
    for name, runs in (("semantic", ours), ("mlx_vlm.server", theirs)):
        cached = [t.cached_tokens for o in runs for t in o.from_turn(warm_from)]
        prompts = [t.prompt_tokens for o in runs for t in o.from_turn(warm_from)]
        note = (f"{workload}: {name} warm turns: prompt {statistics.median(prompts):.0f} tokens (median), cached "
                f"{'not reported' if None in cached else f'{statistics.median(cached):.0f}'}")
        retries = sum(t.retries for o in runs for t in o.turns)
        note += f"; turns sent again after an error: {retries}"
        print(f"# {note}")
        bench.result.notes.append(note)
    for error, count in FAILED_TURNS.items():
        line = f"{workload}: {count} x a server's error in the stream (turn sent again): {error}"
        bench.result.notes.append(line)
        print(f"# {line}")
    FAILED_TURNS.clear()


WORKLOADS = {"screenshots": screenshots, "shared_image": shared_image}


FAMILIES = ("gemma3", "qwen3_5")


def bench_folder(cache_dir: Path, tiny: bool, family: str = "gemma3") -> Path:
    """The bench's model folder, built once under the cache dir (the tokenizer: SmolLM2's)."""
    # (gemma3-vlm2: its projector random; a folder named gemma3-vlm holds another projector and is not read)
    name = "gemma3-vlm2" if family == "gemma3" else family.replace("_", "-") + "-vlm"
    folder = cache_dir / "bench-models" / f"{name}-{'tiny' if tiny else 'bench'}"
    if not (folder / "config.json").is_file():
        smollm2 = Path(resolve_model("smollm2-135m", cache_dir).location)
        if family == "gemma3":
            gemma3_vlm(folder, smollm2, seed=0, size=TINY if tiny else BENCH)
        else:
            qwen_vl_vlm(folder, smollm2, family, seed=0, size=QWEN_VL_TINY if tiny else QWEN3_5_BENCH)
    return folder


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=int, help="runs per server and workload (default: 1 quick, 3 full)")
    parser.add_argument("--tiny-model", action="store_true", help="the tests' tiny model instead (a smoke run)")
    parser.add_argument("--family", choices=FAMILIES, default="gemma3",
                        help="the model's family: gemma3 (one position a token) or qwen3_5 (gated-delta layers, "
                             "multi-axis rotary positions)")
    parser.add_argument("--peer", choices=("defaults", "apc"), default="defaults",
                        help="defaults: `mlx_vlm.server --model FOLDER` as it ships (prefix cache off); apc: with its "
                             "automatic prefix cache on (APC_ENABLED=1)")
    args = parser.parse_args()
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := [w for w in chosen if w not in WORKLOADS]:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    sizes = QUICK if args.quick else FULL
    if args.repeats:
        sizes = replace(sizes, repeats=args.repeats)
    folder = bench_folder(args.cache_dir or default_cache_dir(), args.tiny_model, args.family)
    print(f"# model folder {folder}\n# {'quick' if args.quick else 'full'} sizes: {sizes}\n# peer: mlx_vlm.server "
          f"{'with APC_ENABLED=1' if args.peer == 'apc' else 'at its defaults'}")
    result = BenchResult("bench_vision", "semantic vs mlx_vlm.server (images)",
                         args={"quick": args.quick, "workloads": chosen, "sizes": str(sizes),
                               "model": "tiny" if args.tiny_model else "bench", "family": args.family,
                               "peer": args.peer})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as work:
        bench = Bench(folder, Path(work), sizes, result, peer_apc=args.peer == "apc")
        for name in chosen:
            WORKLOADS[name](bench)
            result.duration_s = time.perf_counter() - started
            result.write(args.json)
    print(f"# finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
