"""Aggregate throughput over time: decode and prefill rates, TTFT, load and totals."""

from __future__ import annotations

import statistics
from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

from engine.runtime.engine_thread.snapshot import EngineSnapshot, ThroughputView

from ..agent_colors import FREE_STYLE

HISTORY_TICKS = 120
"""About 30 s of history at the app's 4 Hz poll."""


def compact_count(n: float) -> str:
    """12 → "12", 20.0 → "20.0", 12_345 → "12.3k", 123_456 → "123k": lines stay narrow.

    Rates (floats) keep one decimal below 100 so the label does not jump between
    "20" and "20.5" from tick to tick; counts (ints) never get one.
    """
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= limit:
            scaled = n / limit
            # Rounded first: 99_999 must read "100k", not "100.0k".
            return f"{scaled:.0f}{suffix}" if round(abs(scaled), 1) >= 100 else f"{scaled:.1f}{suffix}"
    return f"{n:.0f}" if isinstance(n, int) or round(abs(n), 1) >= 100 else f"{n:.1f}"


def duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def rate_label(name: str, tok_s: float) -> Text:
    text = Text(f"{name:<8}")
    text.append(compact_count(tok_s), style="bold")
    text.append(" tok/s")
    return text


def ttft_line(samples: tuple[float, ...]) -> Text:
    if not samples:
        return Text("TTFT –", style=FREE_STYLE)
    low, mid, high = min(samples), statistics.median(samples), max(samples)
    return Text(f"TTFT min {duration(low)} med {duration(mid)} max {duration(high)}")


def load_line(tp: ThroughputView) -> Text:
    return Text(f"queue {tp.queue_depth} · batch {tp.batch_size} · active {tp.active_requests}"
                f" · req {compact_count(tp.requests_total)}")


def totals_line(tp: ThroughputView) -> Text:
    """Tokens generated, prefilled and reused; for a vision model also the images through its vision tower and
    the tower's time (the pane has no row to spare for a line of their own)."""
    text = Text(f"gen {compact_count(tp.generated_total)} · prefill {compact_count(tp.prefilled_total)}"
                f" · reused {compact_count(tp.reused_total)}")
    if tp.vision is not None:
        text.append(f" · img {compact_count(tp.vision.images_encoded)} in {duration(tp.vision.vision_s)}")
    return text


def classes_text(tp: ThroughputView) -> Text:
    """Per agent class, its recent time to first token (median / p95) and gap between tokens (p95 / max), and
    what prefill may take of a step while agents decode; empty before any class has a turn."""
    text = Text()
    if tp.gap_target_s is not None and tp.classes:
        text.append(f"paced prefill {tp.paced_prefill_tokens} tok/step · gap target {duration(tp.gap_target_s)}",
                    style=FREE_STYLE)
    for view in tp.classes:
        if text:
            text.append("\n")
        text.append(f"{view.name:<11}", style="bold")
        if view.ttft_p50_s is not None and view.ttft_p95_s is not None:
            text.append(f" TTFT {duration(view.ttft_p50_s)}/{duration(view.ttft_p95_s)}")
        if view.gap_p95_s is not None and view.gap_max_s is not None:
            text.append(f" · gap p95 {duration(view.gap_p95_s)} max {duration(view.gap_max_s)}")
    return text


class ThroughputPanel(Vertical):
    """Call ``update_snapshot`` once per poll: each new snapshot is one sparkline tick."""

    DEFAULT_CSS = """
    ThroughputPanel { height: auto; }
    ThroughputPanel .throughput-row { height: 1; }
    ThroughputPanel .throughput-row Label { width: 20; }
    ThroughputPanel .throughput-row Sparkline { width: 1fr; height: 1; }
    ThroughputPanel Static { height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    ThroughputPanel #throughput-classes { height: auto; display: none; }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        # Pre-filled with zeros so the time axis is fixed from the first tick: new values
        # enter at the right edge instead of one sample being stretched across the width.
        self._decode: deque[float] = deque([0.0] * HISTORY_TICKS, maxlen=HISTORY_TICKS)
        self._prefill: deque[float] = deque([0.0] * HISTORY_TICKS, maxlen=HISTORY_TICKS)
        self._shown: dict[str, Text] = {}
        self._last: EngineSnapshot | None = None

    @property
    def decode_history(self) -> list[float]:
        return list(self._decode)

    @property
    def prefill_history(self) -> list[float]:
        return list(self._prefill)

    def compose(self) -> ComposeResult:
        idle = ThroughputView()
        with Horizontal(classes="throughput-row"):
            yield Label(rate_label("decode", 0.0), id="throughput-decode-label")
            yield Sparkline(list(self._decode), id="throughput-decode")
        with Horizontal(classes="throughput-row"):
            yield Label(rate_label("prefill", 0.0), id="throughput-prefill-label")
            yield Sparkline(list(self._prefill), id="throughput-prefill")
        yield Static(ttft_line(()), id="throughput-ttft")
        yield Static(load_line(idle), id="throughput-load")
        yield Static(totals_line(idle), id="throughput-totals")
        yield Static(Text(), id="throughput-classes")

    def update_snapshot(self, snapshot: EngineSnapshot) -> None:
        # The app may poll faster than the engine publishes; a repeated snapshot is not a new tick.
        if snapshot is self._last:
            return
        self._last = snapshot
        tp = snapshot.throughput
        self._decode.append(tp.decode_tok_s)
        self._prefill.append(tp.prefill_tok_s)
        # A new list each tick: Sparkline redraws when its reactive `data` is reassigned.
        self.query_one("#throughput-decode", Sparkline).data = list(self._decode)
        self.query_one("#throughput-prefill", Sparkline).data = list(self._prefill)
        self._set("throughput-decode-label", rate_label("decode", tp.decode_tok_s))
        self._set("throughput-prefill-label", rate_label("prefill", tp.prefill_tok_s))
        self._set("throughput-ttft", ttft_line(tp.recent_ttft_s))
        self._set("throughput-load", load_line(tp))
        self._set("throughput-totals", totals_line(tp))
        classes = classes_text(tp)
        self.query_one("#throughput-classes", Static).display = bool(classes)
        if self._shown.get("throughput-classes") != classes:
            self._shown["throughput-classes"] = classes
            self.query_one("#throughput-classes", Static).update(classes)

    def _set(self, widget_id: str, text: Text) -> None:
        if self._shown.get(widget_id) == text:
            return
        self._shown[widget_id] = text
        # Fixed one-line heights and widths: new text never needs a re-layout.
        self.query_one(f"#{widget_id}", Static).update(text, layout=False)
