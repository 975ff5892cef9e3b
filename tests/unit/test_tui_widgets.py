"""Dashboard widgets: pool map, tiers panel, throughput panel, fed engine snapshots."""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import AsyncIterator

import pytest
from rich.color import Color
from textual.app import App, ComposeResult
from textual.pilot import Pilot
from textual.widget import Widget
from textual.widgets import ProgressBar, Sparkline, Static

from engine.runtime.engine_thread.snapshot import EngineSnapshot
from semantic_tui.agent_colors import (
    AGENT_PALETTE,
    PRESSURE_CRITICAL_STYLE,
    PRESSURE_HIGH_STYLE,
    PRESSURE_OK_STYLE,
    agent_color,
    pressure_style,
)
from semantic_tui.widgets.pool_map import (
    COOL_GLYPH,
    FREE_GLYPH,
    GLOBAL_GLYPH,
    SHARED_GLYPH,
    SLIDING_GLYPH,
    PoolMap,
    pressure_line,
)
from semantic_tui.widgets.throughput_panel import HISTORY_TICKS, ThroughputPanel, compact_count
from semantic_tui.widgets.tiers_panel import TiersPanel
from tests.support.dashboard_snapshots import (
    HYBRID_SPEC,
    dashboard_snapshot,
    hybrid_pool,
    pool_snapshot,
    run_turn,
    throughput_series,
)
from tests.support.scripted_engine import ScriptedEngine


class WidgetApp(App):
    def __init__(self, widget: Widget) -> None:
        super().__init__()
        self.widget = widget

    def compose(self) -> ComposeResult:
        yield self.widget


def lines_of(widget: Widget) -> list[str]:
    return [widget.render_line(y).text for y in range(widget.size.height)]


def text_of(widget: Static) -> str:
    return str(widget.content)


@asynccontextmanager
async def mounted(widget: Widget, snapshot: EngineSnapshot, size: tuple[int, int]) -> AsyncIterator[Pilot]:
    """An app around ``widget``, fed one snapshot and settled."""
    async with WidgetApp(widget).run_test(size=size) as pilot:
        widget.update_snapshot(snapshot)
        await pilot.pause()
        yield pilot


# -- colours ----------------------------------------------------------------------------------
def test_agent_color_is_stable_and_from_the_palette():
    assert agent_color("alice") == agent_color("alice")
    assert agent_color("alice") in AGENT_PALETTE
    assert agent_color("alice") != agent_color("bob")
    assert len({agent_color(f"agent-{i}") for i in range(200)}) == len(AGENT_PALETTE)


def test_palette_colours_are_distinct_and_mid_luminance():
    assert len(set(AGENT_PALETTE)) == len(AGENT_PALETTE) >= 10
    for hex_colour in AGENT_PALETTE:
        r, g, b = Color.parse(hex_colour).triplet
        luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
        assert 60 < luminance < 190, hex_colour  # readable on black and on white


@pytest.mark.parametrize(("pressure", "style"), [
    (0.0, PRESSURE_OK_STYLE), (0.69, PRESSURE_OK_STYLE), (0.70, PRESSURE_HIGH_STYLE),
    (0.89, PRESSURE_HIGH_STYLE), (0.90, PRESSURE_CRITICAL_STYLE), (1.0, PRESSURE_CRITICAL_STYLE),
])
def test_pressure_thresholds(pressure, style):
    assert pressure_style(pressure) == style


def test_pressure_line_colours_the_bar_and_percentage():
    used = 60
    line = pressure_line(pool_snapshot(["a"] * used + [None] * (100 - used), [0] * used + [None] * (100 - used)), 60)
    assert "60%" in line.plain and "pressure" in line.plain and "MiB" in line.plain
    assert any(span.style == f"bold {PRESSURE_OK_STYLE}" for span in line.spans)


# -- pool map ---------------------------------------------------------------------------------
async def test_pool_map_from_scripted_engine_turns():
    engine = ScriptedEngine(pool_blocks=64)
    for agent, prompt in (("alice", "hello there " * 8), ("bob", "a longer prompt " * 12)):
        run_turn(engine, agent, prompt)
    snapshot = engine.snapshot()
    pool = snapshot.pool
    assert set(pool.owner_blocks) == {"alice", "bob"}
    pool_map = PoolMap()
    async with mounted(pool_map, snapshot, (40, 10)):
        text = "\n".join(lines_of(pool_map))
    assert f"{pool.used_blocks}/64 blocks used · {pool.free_blocks} free · 0 shared" in text
    assert f"{pool.pressure:.0%}" in text
    assert f"{GLOBAL_GLYPH} global  {FREE_GLYPH} free" in text
    assert SLIDING_GLYPH not in text  # a uniform model has no sliding groups
    assert f"alice {pool.owner_blocks['alice']}" in text and f"bob {pool.owner_blocks['bob']}" in text


async def test_pool_map_colours_dims_and_sliding_glyphs_per_block():
    snapshot = dashboard_snapshot(hybrid_pool(total=96, used=72))
    pool_map = PoolMap()
    async with mounted(pool_map, snapshot, (80, 12)):
        strips = [pool_map.render_line(y) for y in range(pool_map.size.height)]
    # 96 blocks fit spaced (glyph + space) at width 80: 40 per row on rows 2-4, after the summary.
    cells = [(seg.text[i], seg.style) for strip in strips[2:5] for seg in strip for i in range(0, len(seg.text), 2)]
    for block in range(96):
        glyph, style = cells[block]
        if block >= 72:
            assert glyph == FREE_GLYPH and style.dim, block
            continue
        owner = ("alice", "bob", "erin")[(block // 12) % 3]
        if block < snapshot.pool.shared_blocks:  # a prefix two agents hold, in its first holder's colour
            assert glyph == SHARED_GLYPH, block
        else:
            assert glyph == (GLOBAL_GLYPH if block % 6 == 0 else SLIDING_GLYPH), block
        assert style.color.triplet == Color.parse(agent_color(owner)).triplet and not style.dim, block
    assert len({agent_color(a) for a in ("alice", "bob", "erin")}) == 3


async def test_pool_map_summary_and_legend_for_hybrid_model():
    pool_map = PoolMap()
    async with mounted(pool_map, dashboard_snapshot(), (80, 20)):
        lines = lines_of(pool_map)
    assert lines[0].startswith("72/96 blocks used · 24 free · 3 shared")
    assert "75%" in lines[1] and "4.5 MiB / 6.0 MiB" in lines[1]
    legend = next(line for line in lines if "global" in line)
    assert f"{GLOBAL_GLYPH} global  {SLIDING_GLYPH} sliding  {SHARED_GLYPH} shared  {FREE_GLYPH} free" in legend
    assert "1 cell" not in legend


async def test_pool_map_aggregates_a_big_pool():
    owners = [("a", "b", "c", "d")[i // 1000] if i < 4000 else None for i in range(5000)]
    snapshot = dashboard_snapshot(pool_snapshot(owners, [0 if o else None for o in owners], n_groups=1),
                                  spec={"groups": [{"index": 0, "kind": "global", "layers": [0]}]})
    pool_map = PoolMap()
    async with mounted(pool_map, snapshot, (40, 10)):
        lines = lines_of(pool_map)
    per = math.ceil(5000 / (40 * 7))  # 10 rows minus counts, pressure and legend lines
    assert any(f"1 cell = {per} blocks" in line for line in lines)
    grid = "".join(lines[2:-1])
    assert grid.count(GLOBAL_GLYPH) == pytest.approx(4000 / per, abs=2)
    assert all(len(line) <= 40 for line in lines)


@pytest.mark.parametrize("size", [(30, 8), (24, 4), (12, 3)])
async def test_pool_map_fits_tiny_sizes(size):
    pool_map = PoolMap()
    async with mounted(pool_map, dashboard_snapshot(hybrid_pool(total=5000, used=4000)), size):
        lines = lines_of(pool_map)
    assert len(lines) == size[1]
    assert "%" in "".join(lines)
    assert any(ch in "".join(lines) for ch in (GLOBAL_GLYPH, SLIDING_GLYPH))


async def test_pool_map_without_a_pool_says_so():
    pool_map = PoolMap()
    async with mounted(pool_map, EngineSnapshot("swapping", None, None, at=0.0), (40, 5)):
        text = lines_of(pool_map)[0]
    assert text.startswith("no block pool (swapping)")


async def test_pool_map_refreshes_only_on_change():
    pool_map = PoolMap()
    async with mounted(pool_map, dashboard_snapshot(), (40, 10)):
        calls = []
        original = pool_map.refresh
        pool_map.refresh = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
        pool_map.update_snapshot(dashboard_snapshot())  # equal content, new objects
        assert calls == []
        pool_map.update_snapshot(dashboard_snapshot(hybrid_pool(used=60)))
        assert calls == [1]


# -- tiers panel ------------------------------------------------------------------------------
async def test_tiers_panel_counts_rates_and_hit_rate():
    panel = TiersPanel()
    async with mounted(panel, dashboard_snapshot(), (40, 10)):
        agents = text_of(panel.query_one("#tiers-agents", Static))
        movement = text_of(panel.query_one("#tiers-movement", Static))
        hits = text_of(panel.query_one("#tiers-hits", Static))
        bar = panel.query_one("#tiers-disk-bar", ProgressBar)
    assert agents.splitlines() == ["hot  3 agents    4.5 MiB", "warm 2 agents   40.0 MiB of 1.0 GiB", "cold 1 agent   1 discarded"]
    assert movement.splitlines() == ["evictions 1.5/min · →warm 3 →cold 1",
                                     "restores 0.5/min · 2 total"]
    assert hits == "prefix cache hits 75% (3 of 4)"
    assert bar.total == 1024 * 1024 * 1024 and bar.percentage == pytest.approx(40 / 1024)


async def test_tiers_panel_without_disk_tier_hides_the_bar():
    engine = ScriptedEngine(pool_blocks=32)
    run_turn(engine, "solo", "hi " * 10)
    panel = TiersPanel()
    async with mounted(panel, engine.snapshot(), (40, 10)):
        shown = (panel.query_one("#tiers-disk-bar").display, panel.query_one("#tiers-disk-off").display)
        hits = text_of(panel.query_one("#tiers-hits", Static))
        agents = text_of(panel.query_one("#tiers-agents", Static))
    assert shown == (False, True)
    assert hits == "prefix cache hits –"
    assert agents.startswith("hot  1 agent ")


async def test_tiers_panel_updates_only_changed_lines():
    panel = TiersPanel()
    async with mounted(panel, dashboard_snapshot(), (40, 10)):
        updated = []
        for static in panel.query(Static):
            original = static.update
            static.update = lambda *a, _id=static.id, _orig=original, **k: (updated.append(_id), _orig(*a, **k))
        panel.update_snapshot(dashboard_snapshot())
        assert updated == []
        snapshot = dashboard_snapshot()
        panel.update_snapshot(replace(snapshot, tiers=replace(snapshot.tiers, prefix_hits=4)))
        assert updated == ["tiers-hits"]


# -- throughput panel -------------------------------------------------------------------------
def test_compact_count():
    assert [compact_count(n) for n in (0, 12, 12.5, 999, 12_345, 99_999, 4_200_000)] == \
        ["0", "12", "12.5", "999", "12.3k", "100k", "4.2M"]


async def test_throughput_panel_sparklines_and_lines():
    series = throughput_series(24)
    panel = ThroughputPanel()
    async with mounted(panel, series[0], (40, 10)):
        for snapshot in series[1:]:
            panel.update_snapshot(snapshot)
        panel.update_snapshot(series[-1])  # the same snapshot again is not a new tick
        decode = panel.query_one("#throughput-decode", Sparkline).data
        texts = {name: text_of(panel.query_one(f"#throughput-{name}", Static))
                 for name in ("decode-label", "prefill-label", "ttft", "load", "totals")}
    assert len(decode) == HISTORY_TICKS
    assert decode[-24:] == [s.throughput.decode_tok_s for s in series]
    assert panel.prefill_history[-1] == series[-1].throughput.prefill_tok_s
    assert texts["decode-label"] == "decode  20.0 tok/s"
    assert texts["prefill-label"] == "prefill 300 tok/s"
    assert texts["ttft"] == "TTFT min 12ms med 500ms max 1.25s"
    assert texts["load"] == "queue 2 · batch 3 · active 5 · req 42"
    assert texts["totals"] == "gen 12.3k · prefill 100k · reused 4.6k"


async def test_throughput_panel_assigns_a_new_list_each_tick():
    series = throughput_series(3)
    panel = ThroughputPanel()
    async with mounted(panel, series[0], (40, 10)):
        sparkline = panel.query_one("#throughput-decode", Sparkline)
        before = sparkline.data
        panel.update_snapshot(series[1])
        after = sparkline.data
    assert after is not before and before[-1] == series[0].throughput.decode_tok_s


async def test_throughput_panel_without_requests():
    panel = ThroughputPanel()
    async with mounted(panel, EngineSnapshot("ready", None, None, at=0.0), (40, 10)):
        ttft = text_of(panel.query_one("#throughput-ttft", Static))
    assert ttft == "TTFT –"


def test_hybrid_spec_marks_groups_1_to_5_sliding():
    from semantic_tui.widgets.pool_map import sliding_groups_of

    assert sliding_groups_of(dashboard_snapshot(spec=HYBRID_SPEC)) == frozenset(range(1, 6))
    no_model = EngineSnapshot("ready", None, hybrid_pool(), at=0.0)
    assert sliding_groups_of(no_model) == frozenset(range(1, 6))


async def test_tiers_panel_says_when_warm_files_are_quantized():
    snapshot = dashboard_snapshot()
    quantized = replace(snapshot, tiers=replace(snapshot.tiers, warm_kv_bits=8))
    panel = TiersPanel()
    async with mounted(panel, quantized, (48, 10)):
        agents = text_of(panel.query_one("#tiers-agents", Static))
    assert agents.splitlines()[1] == "warm 2 agents   40.0 MiB of 1.0 GiB, 8-bit"


async def test_tiers_panel_says_the_hot_pool_holds_quantized_kv_and_how_many_more_tokens():
    snapshot = dashboard_snapshot()
    quantized = replace(snapshot, tiers=replace(snapshot.tiers, hot_kv_bits=8, hot_token_bytes=1_152,
                                                full_token_bytes=4_096))
    panel = TiersPanel()
    async with mounted(panel, quantized, (60, 10)):
        agents = text_of(panel.query_one("#tiers-agents", Static))
    assert agents.splitlines()[0].endswith(", 8-bit (3.6x tokens)"), agents


async def test_the_pool_map_marks_cool_agents_blocks_and_says_so_in_the_legend():
    snapshot = dashboard_snapshot(hybrid_pool(total=96, used=72))
    agents = tuple(replace(a, tier="cool") if a.agent_id == "bob" else a for a in snapshot.agents)
    pool_map = PoolMap()
    async with mounted(pool_map, replace(snapshot, agents=agents), (80, 12)):
        strips = [pool_map.render_line(y) for y in range(pool_map.size.height)]
    cells = [seg.text[i] for strip in strips[2:5] for seg in strip for i in range(0, len(seg.text), 2)]
    owners = [("alice", "bob", "erin")[(block // 12) % 3] for block in range(72)]
    assert [cells[b] == COOL_GLYPH for b in range(72)] == [o == "bob" for o in owners]
    legend = "".join(seg.text for seg in strips[5])
    assert f"{COOL_GLYPH} cool" in legend


async def test_tiers_panel_shows_the_cool_tier_only_where_agents_are_cooled():
    snapshot = dashboard_snapshot()
    cooled = replace(snapshot, tiers=replace(snapshot.tiers, cool_agents=2, cool_bytes=3 * 2**20, cool_kv_bits=8))
    panel = TiersPanel()
    async with mounted(panel, cooled, (48, 10)):
        agents = text_of(panel.query_one("#tiers-agents", Static))
    assert agents.splitlines()[1] == "cool 2 agents    3.0 MiB, 8-bit"
    assert len(agents.splitlines()) == 4


async def test_pool_map_names_each_layer_group_of_a_model_whose_groups_differ():
    """Gemma 4: a global block of 64-wide heads is 2 pool blocks, a block of the five 32-wide sliding layers
    5; Llama 4's chunked layers draw as windows."""
    from semantic_tui.widgets.pool_map import sliding_groups_of
    from tests.support.tiny_models import loaded_tiny

    spec = loaded_tiny("gemma4_text").spec.describe()
    owners = ["alice"] * 7 + [None] * 9
    pool = pool_snapshot(owners, [0, 0, 1, 1, 1, 1, 1] + [None] * 9, n_groups=2)
    pool_map = PoolMap()
    async with mounted(pool_map, dashboard_snapshot(pool, spec=spec), (80, 12)):
        lines = lines_of(pool_map)
    assert lines[0] == "global 1x64/64 = 2 blk · sliding-24 1x32/32 = 5 blk"
    assert sliding_groups_of(dashboard_snapshot(pool, spec=loaded_tiny("llama4").spec.describe())) == {1, 2, 3}


def test_every_agent_source_has_a_name_in_the_workbench() -> None:
    """A client the server learns to tell apart (Codex CLI, ...) shows under its own name, not its enum value."""
    from engine.domain.requests import AgentSource
    from semantic_tui.chat_events import SOURCE_NAMES
    from semantic_tui.widgets.agents_table import SOURCE_LABELS

    assert {s.value for s in AgentSource} == set(SOURCE_LABELS) == set(SOURCE_NAMES)
    assert SOURCE_LABELS["codex"] == "Codex CLI"


def test_the_cache_history_title_names_state_snapshots_and_checkpoints() -> None:
    from dataclasses import replace

    from semantic_tui.screens.cache_history import _memory

    from engine.runtime.engine_thread.snapshot import AgentView

    view = AgentView(agent_id="hybrid", display_name=None, source="api", state="idle", tier="hot", pinned=False,
                     model_id="m", cached_tokens=900, blocks=10, bytes=60 << 20, turns=3, reuse_ratio=0.9,
                     last_ttft_s=None, decode_tok_s=None, prefill_done=0, prefill_total=0, last_used=0.0,
                     created_at=0.0)
    assert _memory(view) == ""  # attention only: nothing beside K/V
    hybrid = _memory(replace(view, state_bytes=7 << 20, checkpoint_bytes=47 << 20))
    assert "60.0 MiB in the pool" in hybrid and "state 7.0 MiB" in hybrid and "snapshots 47.0 MiB" in hybrid
    assert "checkpoints 3.0 MiB" in _memory(replace(view, checkpoint_bytes=3 << 20))  # sliding windows (Gemma 3)


def test_the_agents_table_shows_kept_drafts_and_tokens_per_speculative_step() -> None:
    from semantic_tui.widgets.agents_table import _drafts

    from engine.domain.speculation_tally import SpeculationTally
    from engine.runtime.engine_thread.snapshot import AgentView

    view = AgentView(agent_id="copier", display_name=None, source="api", state="idle", tier="hot", pinned=False,
                     model_id="m", cached_tokens=900, blocks=10, bytes=60 << 20, turns=3, reuse_ratio=0.9,
                     last_ttft_s=None, decode_tok_s=None, prefill_done=0, prefill_total=0, last_used=0.0,
                     created_at=0.0)
    assert _drafts(view) == "-"  # nothing verified yet
    assert _drafts(replace(view, speculation=SpeculationTally(drafted=100, accepted=92, steps=20, emitted=102))) \
        == "92% x5.1"


# -- memory against the watermarks ----------------------------------------------------------------
_MEMORY = {"pressure": "normal", "system_total_bytes": 24 * 2**30, "system_used_bytes": 6 * 2**30,
           "system_available_bytes": 18 * 2**30, "process_bytes": 2**30, "mlx_active_bytes": 2**29,
           "mlx_cache_bytes": 0, "soft_watermark_bytes": 20 * 2**30, "hard_watermark_bytes": 22 * 2**30}


def test_the_top_line_shows_memory_and_says_what_pressure_does() -> None:
    from semantic_tui.widgets.status_bar import memory_part

    assert memory_part(_MEMORY) == ("mem 6.0/24.0 GiB (soft 20.0)", "dim")
    text, style = memory_part(dict(_MEMORY, pressure="soft", system_used_bytes=21 * 2**30))
    assert "21.0/24.0 GiB > soft 20.0: sending idle agents away" in text and "yellow" in style
    text, style = memory_part(dict(_MEMORY, pressure="hard", system_used_bytes=23 * 2**30))
    assert "> hard 22.0: refusing new requests" in text and "red" in style


def test_the_top_line_names_the_draft_model_drafting_for_the_loaded_one() -> None:
    from engine.runtime.engine_thread.snapshot import ModelView
    from semantic_tui.widgets.status_bar import model_part

    model = ModelView("qwen3-8b", "qwen3@abc", None, "qwen3", 32768, {}, "", "draft model qwen3-0.6b")
    assert model_part(model) == "qwen3-8b (qwen3, ctx 32,768) + draft qwen3-0.6b"
    assert model_part(replace(model, speculation="lookup")) == "qwen3-8b (qwen3, ctx 32,768)"


def test_the_pool_map_draws_memory_with_both_watermarks_marked() -> None:
    from semantic_tui.widgets.pool_map import memory_line, memory_of

    memory = memory_of(replace(EngineSnapshot("ready", None, None), memory=_MEMORY))
    assert memory == (60, 240, 200, 220, 10, "normal")
    line = memory_line(memory, 80).plain
    assert line.startswith("memory ") and "6.0/24.0 GiB · soft 20.0 · hard 22.0 · this 1.0" in line
    bar = line.removeprefix("memory ").split(" ")[0]
    assert bar.index("|") < bar.index("‖") and bar.count("█") == round(6 / 24 * len(bar))
    assert memory_line(memory, 24).plain.count("|") == 1  # narrow: the bar alone, marks kept
