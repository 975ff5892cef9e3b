"""Shared pieces of the benchmarks: model loading, engine start-up, timing, tables."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.formats.rendering import PromptRenderer  # noqa: E402
from engine.domain.chat import ChatMessage, Conversation  # noqa: E402
from engine.models.loaded import LoadedModel  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.platform import blas_report  # noqa: E402
from engine.runtime.engine_thread.engine import Engine  # noqa: E402
from engine.runtime.engine_thread.engine_seams import EngineSeams
from engine.settings import BatchSettings, CacheSettings, EngineSettings  # noqa: E402
from engine.settings import default_cache_dir  # noqa: E402


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m", help="model alias, folder or .gguf (default: smollm2-135m)")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="where imported models live")
    parser.add_argument("--pool-mb", type=float, default=2048, help="KV pool budget in MiB")
    parser.add_argument("--quick", action="store_true", help="smaller workload, for a smoke run")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write the results as JSON (bench/results.py) for bench/report.py")
    return parser


def load(args: argparse.Namespace) -> LoadedModel:
    t0 = time.perf_counter()
    loaded = load_model(args.model, args.cache_dir, 256)
    print(f"# model {loaded.model_id} ({loaded.architecture}) loaded in {time.perf_counter() - t0:.1f} s")
    print(f"# BLAS: {blas_report()}")
    if "openblas" not in os.environ.get("LD_PRELOAD", "") and sys.platform.startswith("linux"):
        print("# warning: OpenBLAS not preloaded; run through `make bench` or set LD_PRELOAD")
    return loaded


def start_engine(
    loaded: LoadedModel, pool_mb: float, batch: int = 16, prefill_step: int = 512, store=None, prefix_sharing: bool = True,
    kv_bits: int | None = None, backend=None,
) -> Engine:
    """A started engine; ``backend``: a compute backend to compare (default: the one chosen for this device)."""
    settings = EngineSettings(cache=CacheSettings(int(pool_mb * 2**20), prefix_sharing=prefix_sharing,
                                                  kv_bits_at_rest=kv_bits),
                              batch=BatchSettings(batch, prefill_step))
    engine = Engine(loaded, settings, store=store, seams=EngineSeams(backend=backend))
    engine.start()
    return engine


@contextmanager
def timed() -> Iterator[list[float]]:
    box: list[float] = []
    t0 = time.perf_counter()
    yield box
    box.append(time.perf_counter() - t0)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn``, after one untimed call (a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def render_chat(loaded: LoadedModel, messages: list[dict]) -> tuple[int, ...]:
    """``messages`` (role / content dicts) as prompt tokens: the model's chat template, or for a base
    model without one (Gemma 3 270M) the plain rendering the server gives it."""
    if getattr(loaded.tokenizer, "chat_template", None):
        return tuple(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    conversation = Conversation(tuple(ChatMessage(m["role"], m["content"]) for m in messages))
    return tuple(PromptRenderer(loaded.tokenizer).render(conversation))
