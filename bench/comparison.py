"""Turning both servers' timed turns into comparable numbers, tables and a summary.

Every ratio is a "semantic advantage": above 1 means semantic did better,
whether the metric is a time (lower is better) or a rate (higher is better).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from chat_stream import Turn
from common import print_table

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Row:
    metric: str
    semantic: float | None
    peer: float | None
    lower_is_better: bool = True

    @property
    def advantage(self) -> float | None:
        if self.semantic is None or self.peer is None:
            return None
        ours, theirs = (self.peer, self.semantic) if self.lower_is_better else (self.semantic, self.peer)
        return ours / theirs if theirs > 0 else None


@dataclass(slots=True)
class Report:
    highlights: list[tuple[str, Row]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, workload: str, rows: list[Row], highlight: tuple[str, ...]) -> None:
        print_table(["metric", "semantic", "mlx_lm.server", "semantic advantage x"],
                    [[r.metric, cell(r.semantic), cell(r.peer), cell(r.advantage)] for r in rows])
        self.highlights += [(workload, r) for r in rows if r.metric in highlight]

    def note_retries(self, workload: str, ours: list[Turn], theirs: list[Turn]) -> None:
        counts = {"semantic": sum(t.retries for t in ours), "mlx_lm.server": sum(t.retries for t in theirs)}
        if any(counts.values()):
            self.notes.append(f"{workload}: requests retried (refused, or connection dropped unanswered): "
                              + ", ".join(f"{name} {n}" for name, n in counts.items()))
            print(self.notes[-1])

    def summary(self) -> None:
        print("\n## Summary (semantic advantage x: above 1 means semantic did better)")
        print_table(["workload", "metric", "semantic", "mlx_lm.server", "semantic advantage x"],
                    [[w, r.metric, cell(r.semantic), cell(r.peer), cell(r.advantage)] for w, r in self.highlights])
        for note in self.notes:
            print(note)


def cell(value: float | None) -> object:
    """A table cell: a number, or "n/a" where a server does not report it."""
    return "n/a" if value is None else value


def mean_ttft(turns: list[Turn]) -> float | None:
    return statistics.fmean(t.ttft_s for t in turns) if turns else None


def median_ttft(turns: list[Turn]) -> float | None:
    return statistics.median(t.ttft_s for t in turns) if turns else None


def cached_percent(turns: list[Turn]) -> float | None:
    if not turns or any(t.cached_tokens is None for t in turns):
        return None
    return 100 * sum(t.cached_tokens or 0 for t in turns) / max(sum(t.prompt_tokens for t in turns), 1)


def decode_tok_s(turns: list[Turn]) -> float:
    """Tokens after each stream's first, over the span from the first first token to the last finish.

    The first token of a stream comes out of its prefill, so it is left out;
    streams admitted later (a prefill batch holds 4) stretch the span, which is
    a real cost of serving them.
    """
    span = max(t.done_at for t in turns) - min(t.first_token_at for t in turns)
    return sum(max(t.completion_tokens - 1, 0) for t in turns) / max(span, 1e-9)


def median_of(measure: Callable[[T], float | None], runs: list[T]) -> float | None:
    values = [measure(run) for run in runs]
    return None if any(v is None for v in values) else statistics.median(values)  # type: ignore[type-var]
