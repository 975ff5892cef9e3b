"""Turning both servers' timed turns into paired comparisons, tables and per-turn numbers.

Every ratio is a "semantic advantage": above 1 means semantic did better,
whether the metric is a time (lower is better) or a rate (higher is better).
Each repeat of a workload runs both servers back to back, so repeat i of one
is paired with repeat i of the other and the spread of the ratios shows how
much the machine's noise moved the result.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import TypeVar

from bench.chat_stream import Turn
from bench.common import print_table
from bench.results import BenchResult, Comparison, compare

T = TypeVar("T")


def mean_ttft(turns: list[Turn]) -> float:
    return statistics.fmean(t.ttft_s for t in turns)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: with 16 samples p95 is the largest but one, never an interpolation."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ttft_percentile(turns: list[Turn], q: float) -> float:
    return percentile([t.ttft_s for t in turns], q)


def prefilled_tokens(turns: list[Turn]) -> float:
    """Prompt tokens the server computed rather than took from a cache, by its own usage report."""
    return float(sum(t.prompt_tokens - (t.cached_tokens or 0) for t in turns))


def cached_percent(turns: list[Turn]) -> float:
    return 100 * sum(t.cached_tokens or 0 for t in turns) / max(sum(t.prompt_tokens for t in turns), 1)


def aggregate_tok_s(turns: list[Turn]) -> float:
    """Completion tokens of a burst over its wall time, first request sent to last answer done."""
    span = max(t.done_at for t in turns) - min(t.sent_at for t in turns)
    return sum(t.completion_tokens for t in turns) / max(span, 1e-9)


def paired(result: BenchResult, workload: str, metric: str, unit: str, measure: Callable[[T], float],
           ours: list[T], theirs: list[T], *, better: str = "lower", target: float | None = None) -> Comparison:
    """``measure`` of every run on both servers, recorded in ``result`` as one comparison."""
    comparison = compare(workload, metric, unit, [measure(run) for run in ours], [measure(run) for run in theirs],
                         better=better, target=target)
    result.comparisons.append(comparison)
    return comparison


def print_comparisons(comparisons: list[Comparison], peer: str = "mlx_lm.server") -> None:
    print_table(
        ["metric", "semantic", peer, "advantage x (min-max)", "target"],
        [[c.metric, _spread(c.semantic.median, c.semantic.min, c.semantic.max, c.unit),
          _spread(c.peer.median, c.peer.min, c.peer.max, c.unit),
          _spread(c.advantage.median, c.advantage.min, c.advantage.max, "x"), _target(c)] for c in comparisons],
    )


def _spread(median: float, low: float, high: float, unit: str) -> str:
    if low == high:
        return f"{_num(median)} {unit}"
    return f"{_num(median)} {unit} ({_num(low)}-{_num(high)})"


def _num(value: float) -> str:
    if value != value or math.isinf(value):
        return str(value)
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"


def _target(c: Comparison) -> str:
    if c.target is None:
        return ""
    return f">= {c.target:g}x {'met' if c.met else 'MISSED'}"


def retries_note(workload: str, ours: list[Turn], theirs: list[Turn]) -> str | None:
    counts = {"semantic": sum(t.retries for t in ours), "mlx_lm.server": sum(t.retries for t in theirs)}
    if not any(counts.values()):
        return None
    return (f"{workload}: requests retried (refused with 429/503, or connection dropped unanswered): "
            + ", ".join(f"{name} {n}" for name, n in counts.items()))
