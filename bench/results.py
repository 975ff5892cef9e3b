"""The one JSON shape every benchmark writes with ``--json PATH``, read back by ``report.py``.

A result file holds what one benchmark measured in one run:

- ``metrics``: single numbers (decode tok/s at 8 agents, block allocation p95...).
- ``comparisons``: semantic against mlx_lm.server on one metric, with every
  repeat's value on both sides, so the report can give min/median/max of each
  side and of the per-repeat ratio ("semantic advantage": above 1 means
  semantic did better, whether the metric is a time or a rate), and whether a
  target ratio was met.
- ``series``: x/y data the report draws as a plot.
- ``notes``: sentences the numbers need (why a target was missed, a profile).

Plain dataclasses and ``json``: the files must stay readable by anyone with a
text editor, and the report must not need the engine installed.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.portable_paths import portable

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class Metric:
    group: str  # the table this number belongs in, e.g. "decode throughput"
    name: str
    value: float
    unit: str
    better: str = "higher"  # "higher", "lower", or "neither" for context (a prompt's size, a count)
    target: float | None = None  # a budget the issue sets (allocation p95 under 0.01 ms...)

    @property
    def met(self) -> bool | None:
        if self.target is None or self.better == "neither":
            return None
        return self.value <= self.target if self.better == "lower" else self.value >= self.target


@dataclass(frozen=True, slots=True)
class Spread:
    """min / median / max of one side's values over the repeats."""

    min: float
    median: float
    max: float
    values: list[float]

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(min(values), statistics.median(values), max(values), list(values))


@dataclass(frozen=True, slots=True)
class Comparison:
    workload: str
    metric: str
    unit: str
    better: str  # "higher" or "lower"
    semantic: Spread
    peer: Spread
    # Per repeat: the peer's value over ours for a time, ours over the peer's for a rate.
    advantage: Spread
    target: float | None = None  # the advantage this workload must reach, if the issue sets one

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.advantage.median >= self.target


def compare(workload: str, metric: str, unit: str, ours: list[float], theirs: list[float], *,
            better: str = "lower", target: float | None = None) -> Comparison:
    """Pair repeat i of semantic with repeat i of the peer: both ran back to back under the same load."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"{workload}/{metric}: {len(ours)} semantic runs vs {len(theirs)} peer runs")
    ratios = [_advantage(a, b, better) for a, b in zip(ours, theirs, strict=True)]
    return Comparison(workload, metric, unit, better, Spread.of(ours), Spread.of(theirs), Spread.of(ratios), target)


def _advantage(ours: float, theirs: float, better: str) -> float:
    if better == "lower":
        return theirs / ours if ours > 0 else float("inf")
    return ours / theirs if theirs > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class Series:
    """One plot: a shared x axis and one or more named lines."""

    name: str
    xlabel: str
    ylabel: str
    x: list[float]
    lines: dict[str, list[float]]
    kind: str = "line"  # "line" or "bar"
    x_labels: list[str] | None = None  # tick labels when x only numbers categories (which swap, which mode)


@dataclass(slots=True)
class BenchResult:
    bench: str
    title: str
    args: dict[str, Any] = field(default_factory=dict)
    metrics: list[Metric] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    series: list[Series] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=lambda: machine_info())
    started_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    duration_s: float = 0.0
    schema: int = SCHEMA_VERSION

    def metric(self, group: str, name: str, value: float, unit: str, better: str = "higher",
               target: float | None = None) -> None:
        self.metrics.append(Metric(group, name, float(value), unit, better, target))

    def write(self, path: Path | None) -> None:
        """Atomically: a report generator reading the folder never sees half a file."""
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as out:
            json.dump(portable(asdict(self)), out, indent=1, allow_nan=True)
        os.replace(partial, path)
        print(f"# results written to {path}")


@contextmanager
def recorded(result: BenchResult, path: Path | None) -> Iterator[BenchResult]:
    """Time the run and write the file even when it fails half way: the report shows what was measured."""
    start = time.perf_counter()
    try:
        yield result
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        result.notes.append(f"The run stopped early ({reason}); these results are partial.")
        raise
    finally:
        result.duration_s = time.perf_counter() - start
        result.write(path)


def load_result(path: Path) -> BenchResult:
    raw = json.loads(path.read_text())
    if raw.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema {raw.get('schema')!r}, expected {SCHEMA_VERSION}")
    comparisons = [Comparison(**{**c, "semantic": Spread(**c["semantic"]), "peer": Spread(**c["peer"]),
                                 "advantage": Spread(**c["advantage"])}) for c in raw["comparisons"]]
    return BenchResult(
        bench=raw["bench"], title=raw["title"], args=raw["args"],
        metrics=[Metric(**m) for m in raw["metrics"]], comparisons=comparisons,
        series=[Series(**s) for s in raw["series"]], notes=raw["notes"], machine=raw["machine"],
        started_at=raw["started_at"], duration_s=raw["duration_s"],
    )


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: the cores, the BLAS, the MLX backend, how busy it was."""
    info: dict[str, Any] = {
        "platform": platform.platform(), "machine": platform.machine(), "python": sys.version.split()[0],
        "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import mlx.core as mx
        import mlx_lm

        info["mlx"] = getattr(mx, "__version__", "?")
        info["mlx_lm"] = getattr(mlx_lm, "__version__", "?")
        info["mlx_device"] = str(mx.default_device())
    except Exception:  # the report can be built on a machine without MLX
        pass
    info["ld_preload"] = os.environ.get("LD_PRELOAD", "")
    return info
