"""SVG snapshots of the dashboard widgets at small sizes, fed fixed snapshots.

Update the baselines with ``pytest --snapshot-update`` after an intended change
and look at the SVGs before committing them.
"""

from __future__ import annotations

from typing import Callable

from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widget import Widget

from engine.runtime.engine_thread.snapshot import EngineSnapshot
from semantic_tui.widgets.pool_map import PoolMap
from semantic_tui.widgets.throughput_panel import ThroughputPanel
from semantic_tui.widgets.tiers_panel import TiersPanel
from tests.support.dashboard_snapshots import dashboard_snapshot, hybrid_pool, throughput_series
from themes import register_themes


class DashboardApp(App):
    """Widgets made by ``build``, fed ``snapshots`` in order on mount, in one of our themes."""

    CSS = """
    .panel { border: round $primary; height: 1fr; }
    """

    def __init__(self, build: Callable[[], list[Widget]], snapshots: list[EngineSnapshot],
                 theme: str = "semantic-dark") -> None:
        super().__init__()
        self._build, self._snapshots, self._theme_name = build, snapshots, theme

    def compose(self) -> ComposeResult:
        yield from self._build()

    def on_mount(self) -> None:
        register_themes(self)
        self.theme = self._theme_name
        for snapshot in self._snapshots:
            for widget in self.query("PoolMap, TiersPanel, ThroughputPanel"):
                widget.update_snapshot(snapshot)


def test_pool_map_hybrid_small(snap_compare):
    app = DashboardApp(lambda: [PoolMap()], [dashboard_snapshot()])
    assert snap_compare(app, terminal_size=(40, 10))


def test_pool_map_aggregated_small(snap_compare):
    app = DashboardApp(lambda: [PoolMap()], [dashboard_snapshot(hybrid_pool(total=5000, used=4100))])
    assert snap_compare(app, terminal_size=(40, 10))


def test_pool_map_light_theme(snap_compare):
    app = DashboardApp(lambda: [PoolMap()], [dashboard_snapshot()], theme="semantic-light")
    assert snap_compare(app, terminal_size=(40, 10))


def test_tiers_panel_small(snap_compare):
    app = DashboardApp(lambda: [TiersPanel()], [dashboard_snapshot()])
    assert snap_compare(app, terminal_size=(40, 10))


def test_throughput_panel_small(snap_compare):
    app = DashboardApp(lambda: [ThroughputPanel()], throughput_series(24))
    assert snap_compare(app, terminal_size=(40, 10))


def _dashboard() -> list[Widget]:
    left = PoolMap(classes="panel")
    right = Vertical(TiersPanel(classes="panel"), ThroughputPanel(classes="panel"))
    return [Horizontal(left, right)]


def test_dashboard_80x24(snap_compare):
    app = DashboardApp(_dashboard, throughput_series(24))
    assert snap_compare(app, terminal_size=(80, 24))
