"""The block-pool map: one cell per KV block, coloured by the agent holding it."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from itertools import product
from typing import NamedTuple

from rich.text import Text
from textual.widget import Widget

from engine.domain.block_pool import PoolSnapshot
from engine.runtime.engine_thread.snapshot import EngineSnapshot

from ..agent_colors import FREE_STYLE, agent_color, pressure_style
from ..formatting import human_bytes

GLOBAL_GLYPH = "█"
SLIDING_GLYPH = "▒"
SHARED_GLYPH = "▓"  # a block several agents hold (a shared prefix), in its first holder's colour
KEPT_GLYPH = "▣"  # a block of an agent a client's cache_control breakpoint asked to keep
COOL_GLYPH = "▪"  # a block paying for an idle agent's cache quantized in memory (--kv-bits-at-rest)
FREE_GLYPH = "·"
BAR_FILL, BAR_EMPTY = "█", "░"
MIN_BAR = 10  # below this the bar says little; drop the label, then the byte sizes


@dataclass(frozen=True, slots=True)
class PoolView:
    """What the map draws; equal views render identically, so an equal one skips the refresh."""

    pool: PoolSnapshot
    sliding_groups: frozenset[int]
    labels: tuple[tuple[str, str], ...]
    # Agents under a live cache_control retention: evicted only after every unmarked agent.
    kept: frozenset[str] = frozenset()
    # Cool agents: their blocks hold a quantized cache, not K/V the batch reads.
    cool: frozenset[str] = frozenset()
    # A sharded model's ranks: (rank, MLX bytes in use there). Each holds its shard of every block.
    ranks: tuple[tuple[int, int], ...] = ()
    # Layer groups of different geometry (Gemma 4): each kind's block size in pool blocks and its K/V shape.
    groups: tuple[str, ...] = ()
    # The machine's memory against the watermarks, in tenths of a GiB (so a redraw follows a visible change):
    # (used, total, soft, hard, this process, pressure).
    memory: tuple[int, int, int, int, int, str] | None = None


@dataclass(frozen=True, slots=True)
class GridLayout:
    blocks_per_cell: int
    cell_width: int  # 2 leaves a space after each glyph, 1 packs them
    columns: int
    rows: int


class Cell(NamedTuple):
    # A NamedTuple, not a frozen dataclass: a big pool makes thousands per redraw.
    owner: str | None
    sliding: bool
    shared: bool = False
    kept: bool = False
    cool: bool = False


def sliding_groups_of(snapshot: EngineSnapshot) -> frozenset[int]:
    """Indices of sliding-window layer groups, from the model's cache spec.

    Without a spec, fall back on the cache-spec convention that group 0 is the
    global one and any further groups exist only because of sliding layers.
    """
    spec = snapshot.model.spec if snapshot.model is not None else {}
    groups = spec.get("groups") if isinstance(spec, dict) else None
    if isinstance(groups, list) and groups:
        return frozenset(g["index"] for g in groups if str(g.get("kind", "")).startswith(("sliding", "chunked")))
    n_groups = snapshot.pool.n_groups if snapshot.pool is not None else 1
    return frozenset(range(1, n_groups))


def group_shapes_of(snapshot: EngineSnapshot) -> tuple[str, ...]:
    """For a model whose layer groups differ in geometry: per kind, ``kind k×K/V = n blocks`` (a block of that
    group takes n pool blocks); empty for a uniform model, whose every block is one pool block."""
    spec = snapshot.model.spec if snapshot.model is not None else {}
    groups = spec.get("groups") if isinstance(spec, dict) else None
    if not isinstance(groups, list) or not any("geometry" in g for g in groups):
        return ()
    unit = spec.get("block_bytes") or 1
    shapes: dict[str, None] = {}
    for g in groups:
        geometry = g.get("geometry", {})
        shape = f"{geometry.get('n_kv_heads')}x{geometry.get('head_dim')}/{geometry.get('v_head_dim')}"
        shapes[f"{g['kind']} {shape} = {g.get('block_bytes', unit) // unit} blk"] = None
    return tuple(shapes)


def groups_line(groups: tuple[str, ...], width: int) -> Text:
    return Text(_first_fit([" · ".join(groups), f"{len(groups)} kinds of layer group"], width), style="dim")


def plan_grid(total_blocks: int, width: int, rows: int) -> GridLayout:
    """Spaced cells when everything fits, packed cells next, else several blocks per cell."""
    width, rows = max(1, width), max(1, rows)
    spaced = (width + 1) // 2
    if width >= 2 and total_blocks <= spaced * rows:
        return GridLayout(1, 2, spaced, max(1, math.ceil(total_blocks / spaced)))
    per = max(1, math.ceil(total_blocks / (width * rows)))
    cells = math.ceil(total_blocks / per)
    return GridLayout(per, 1, width, max(1, math.ceil(cells / width)))


def aggregate_cells(view: PoolView, per: int) -> list[Cell]:
    """One cell per ``per`` consecutive blocks, showing the chunk's most common holder.

    Free counts as a holder, so a mostly free chunk reads as free; a tie goes
    to an agent so a lightly used region never looks empty, then to the first seen.
    The cell is sliding when most of that holder's blocks in the chunk are.
    """
    owners, groups, sliding, kept = view.pool.block_owner, view.pool.block_group, view.sliding_groups, view.kept
    holders = view.pool.block_holders or (1,) * len(owners)
    cool = view.cool
    if per == 1:
        return [Cell(o, o is not None and g in sliding, h > 1, o in kept, o in cool)
                for o, g, h in zip(owners, groups, holders)]
    # Counting the few global groups with tuple.count keeps the per-block work in C.
    global_groups = tuple(set(range(view.pool.n_groups)) - sliding)
    cells = []
    for start in range(0, len(owners), per):
        chunk, chunk_groups = owners[start : start + per], groups[start : start + per]
        # Agents usually hold runs of blocks, so most chunks have a single holder.
        uniform = chunk.count(chunk[0]) == len(chunk)
        owner = chunk[0] if uniform else _dominant(chunk, per)
        if owner is None:
            cells.append(Cell(None, False))
            continue
        held = chunk_groups if uniform else tuple(g for o, g in zip(chunk, chunk_groups) if o == owner)
        n_global = sum(held.count(g) for g in global_groups)
        n_shared = sum(1 for h in holders[start : start + per] if h > 1)
        cells.append(Cell(owner, (len(held) - n_global) * 2 > len(held), n_shared * 2 > len(chunk), owner in kept,
                          owner in cool))
    return cells


def _dominant(chunk: tuple[str | None, ...], per: int) -> str | None:
    # Counter's C loop wins on long chunks; on short ones its setup costs more than counting.
    counts = Counter(chunk) if per > 16 else {o: chunk.count(o) for o in dict.fromkeys(chunk)}
    return max(counts, key=lambda o: (counts[o], o is not None))


def grid_lines(cells: list[Cell], layout: GridLayout) -> list[Text]:
    """Rows of cells; neighbours of one style share a span so big grids stay cheap to draw."""
    gap = " " * (layout.cell_width - 1)
    lines = []
    for row in range(layout.rows):
        line, run, run_style = Text(), [], ""
        for cell in cells[row * layout.columns : (row + 1) * layout.columns]:
            glyph, style = _cell_glyph(cell)
            if style != run_style and run:
                line.append("".join(run), style=run_style)
                run = []
            run.append(glyph + gap)
            run_style = style
        line.append("".join(run), style=run_style)
        lines.append(line)
    return lines


def _cell_glyph(cell: Cell) -> tuple[str, str]:
    if cell.owner is None:
        return FREE_GLYPH, FREE_STYLE
    if cell.cool:
        return COOL_GLYPH, agent_color(cell.owner)
    if cell.shared:
        return SHARED_GLYPH, agent_color(cell.owner)
    if cell.kept:
        return KEPT_GLYPH, agent_color(cell.owner)
    return (SLIDING_GLYPH if cell.sliding else GLOBAL_GLYPH), agent_color(cell.owner)


def _first_fit(candidates: list[str], width: int) -> str:
    return next((c for c in candidates if len(c) <= width), candidates[-1][:width])


def counts_line(pool: PoolSnapshot, width: int) -> Text:
    used, total, free, shared = pool.used_blocks, pool.total_blocks, pool.free_blocks, pool.shared_blocks
    return Text(_first_fit([
        f"{used:,}/{total:,} blocks used · {free:,} free · {shared:,} shared",
        f"{used:,}/{total:,} used · {free:,} free · {shared:,} shared",
        f"{used}/{total} used · {free} free · {shared} sh",
        f"{used}/{total} used · {shared} sh",
    ], width))


def ranks_line(ranks: tuple[tuple[int, int], ...], width: int) -> Text:
    """A sharded model: every rank holds its shard of each block below, and this much memory."""
    memory = " · ".join(f"r{rank} {human_bytes(nbytes)}" for rank, nbytes in ranks)
    return Text(_first_fit([
        f"{len(ranks)} ranks, each a shard of every block: {memory}",
        f"{len(ranks)} ranks: {memory}",
        f"{len(ranks)} ranks",
    ], width), style="dim")


def memory_of(snapshot: EngineSnapshot) -> tuple[int, int, int, int, int, str] | None:
    """The snapshot's memory reading as the pool map draws it (tenths of a GiB)."""
    m = snapshot.memory
    if not m:
        return None
    tenths = [round(int(m[k]) / 2**30 * 10) for k in ("system_used_bytes", "system_total_bytes",
                                                        "soft_watermark_bytes", "hard_watermark_bytes", "process_bytes")]
    return (*tenths, str(m["pressure"]))  # type: ignore[return-value]


def memory_line(memory: tuple[int, int, int, int, int, str], width: int) -> Text:
    """The machine's memory in use as a bar with the soft (|) and hard (‖) watermarks marked, in the
    pressure's colour, and the numbers if they fit."""
    used, total, soft, hard, process, pressure = memory
    g = lambda tenths: f"{tenths / 10:.1f}"  # noqa: E731
    tails = [f" {g(used)}/{g(total)} GiB · soft {g(soft)} · hard {g(hard)} · this {g(process)}",
             f" {g(used)}/{g(total)} GiB", ""]
    label = "memory "
    tail = next((t for t in tails if width - len(label) - len(t) >= MIN_BAR), "")
    bar_width = max(1, width - len(label) - len(tail))
    style = {"normal": "green", "soft": "bold yellow", "hard": "bold red"}[pressure]
    cells = [BAR_FILL if i < round(used / max(total, 1) * bar_width) else BAR_EMPTY for i in range(bar_width)]
    for mark, glyph in ((soft, "|"), (hard, "‖")):
        cells[min(bar_width - 1, round(mark / max(total, 1) * bar_width))] = glyph
    line = Text(label)
    for cell in cells:
        line.append(cell, style=style if cell == BAR_FILL else ("bold" if cell in "|‖" else FREE_STYLE))
    line.append(tail, style=style if pressure != "normal" else "")
    return line


def pressure_line(pool: PoolSnapshot, width: int) -> Text:
    """A bar in the pressure colour, the percentage, and used/total bytes if they fit."""
    percent = f" {pool.pressure:.0%}"
    size = f"  {human_bytes(pool.used_bytes)} / {human_bytes(pool.total_bytes)}"
    forms = (("pressure ", size), ("", size), ("", ""))
    label, tail = next((form for form in forms if width - len("".join(form)) - len(percent) >= MIN_BAR), forms[-1])
    bar_width = max(1, width - len(label) - len(percent) - len(tail))
    filled = round(pool.pressure * bar_width)
    style = pressure_style(pool.pressure)
    line = Text(label)
    line.append(BAR_FILL * filled, style=style)
    line.append(BAR_EMPTY * (bar_width - filled), style=FREE_STYLE)
    line.append(percent, style=f"bold {style}")
    line.append(tail)
    return line


def legend_line(hybrid: bool, per: int, width: int, shared: bool = False, kept: bool = False,
                cool: bool = False) -> Text:
    """Glyph meanings and, when blocks are aggregated, the scale."""
    glyph_forms = [
        [f"{GLOBAL_GLYPH} global", f"{SLIDING_GLYPH} sliding", f"{SHARED_GLYPH} shared", f"{KEPT_GLYPH} kept",
         f"{COOL_GLYPH} cool", f"{FREE_GLYPH} free"],
        [f"{GLOBAL_GLYPH} glb", f"{SLIDING_GLYPH} sld", f"{SHARED_GLYPH} shr", f"{KEPT_GLYPH} kpt",
         f"{COOL_GLYPH} cool", f"{FREE_GLYPH} free"],
        [f"{GLOBAL_GLYPH}glb", f"{SLIDING_GLYPH}sld", f"{SHARED_GLYPH}shr", f"{KEPT_GLYPH}kpt",
         f"{COOL_GLYPH}cool", f"{FREE_GLYPH}free"],
    ]
    scale_forms = [f"1 cell = {per} blocks", f"1 cell={per} blocks", f"1 cell={per} blk"] if per > 1 else [""]
    candidates = []
    for glyphs, scale, sep in product(glyph_forms, scale_forms, ("  ", " ")):
        shown = [g for g, keep in zip(glyphs, (True, hybrid, shared, kept, cool, True)) if keep]
        candidates.append(sep.join([*shown, scale]).rstrip())
    return _style_glyphs(_first_fit(candidates, width))


def _style_glyphs(legend: str) -> Text:
    text = Text(legend, style="dim")
    for i, char in enumerate(legend):
        if char == FREE_GLYPH:
            text.stylize(FREE_STYLE, i, i + 1)
        elif char in (GLOBAL_GLYPH, SLIDING_GLYPH, SHARED_GLYPH, KEPT_GLYPH, COOL_GLYPH):
            text.stylize("not dim", i, i + 1)
    return text


def owners_line(view: PoolView, width: int) -> Text:
    """The biggest holders first, each with its colour swatch, as many as fit."""
    labels = dict(view.labels)
    ranked = sorted(view.pool.owner_blocks.items(), key=lambda item: (-item[1], item[0]))
    line = Text()
    for owner, blocks in ranked:
        entry = f"{GLOBAL_GLYPH} {labels.get(owner, owner)} {blocks}"
        if line.cell_len + len(entry) + 2 > width:
            break
        if line.cell_len:
            line.append("  ")
        line.append(GLOBAL_GLYPH, style=agent_color(owner))
        line.append(entry[1:])
    return line


def render_pool(view: PoolView, width: int, height: int) -> Text:
    """Header lines, the grid, the legend, then the owners if a row is left over."""
    pool = view.pool
    # Short widgets drop the counts line first, then the legend: the grid always keeps a row.
    header = [ranks_line(view.ranks, width)] if view.ranks and height >= 6 else []
    header += [groups_line(view.groups, width)] if view.groups and height >= 6 else []
    header += [counts_line(pool, width)] if height >= 4 else []
    header += [pressure_line(pool, width)] if height >= 2 else []
    header += [memory_line(view.memory, width)] if view.memory is not None and height >= 7 else []
    legend_rows = 1 if height >= 3 else 0
    layout = plan_grid(pool.total_blocks, width, height - len(header) - legend_rows)
    lines = [*header, *grid_lines(aggregate_cells(view, layout.blocks_per_cell), layout)]
    if legend_rows:
        kept = any(owner in view.kept for owner in view.pool.owner_blocks)
        lines.append(legend_line(bool(view.sliding_groups), layout.blocks_per_cell, width,
                                 view.pool.shared_blocks > 0, kept, bool(view.cool)))
    if len(lines) < height and pool.owner_blocks:
        lines.append(owners_line(view, width))
    return Text("\n").join(lines[:height])


class PoolMap(Widget):
    """Call ``update_snapshot`` at any rate: it redraws only when the pool or the size changed."""

    DEFAULT_CSS = """
    PoolMap {
        width: 1fr;
        height: 1fr;
        min-height: 3;
        text-wrap: nowrap;
        text-overflow: clip;
    }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._view: PoolView | None = None
        self._status = "starting"

    def update_snapshot(self, snapshot: EngineSnapshot) -> None:
        view = None
        if snapshot.pool is not None:
            owners = snapshot.pool.owner_blocks
            labels = tuple(sorted((a.agent_id, a.label) for a in snapshot.agents if a.agent_id in owners))
            kept = frozenset(a.agent_id for a in snapshot.agents if a.retained_s > 0 and a.agent_id in owners)
            cool = frozenset(a.agent_id for a in snapshot.agents if a.tier == "cool" and a.agent_id in owners)
            ranks = tuple((r.rank, r.active_bytes) for r in snapshot.ranks)
            view = PoolView(snapshot.pool, sliding_groups_of(snapshot), labels, kept, cool, ranks,
                            group_shapes_of(snapshot), memory_of(snapshot))
        if view == self._view and snapshot.status == self._status:
            return
        self._view, self._status = view, snapshot.status
        self.refresh()

    def render(self) -> Text:
        if self._view is None:
            return Text(f"no block pool ({self._status})", style="dim")
        return render_pool(self._view, self.size.width, self.size.height)
