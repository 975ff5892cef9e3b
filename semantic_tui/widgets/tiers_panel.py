"""Where agents' caches live: hot (pool), warm (disk), cold (gone), and how they move."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar, Static

from engine.runtime.engine_thread.snapshot import EngineSnapshot, TierView

from ..agent_colors import FREE_STYLE, TIER_STYLES
from ..formatting import human_bytes


EVICTION_ORDER = {"cool": 0, "warm": 1, "cold": 2}  # down the tiers, not alphabetical


def _agents(n: int) -> str:
    return f"{n} agent" if n == 1 else f"{n} agents"


def tier_lines(tiers: TierView) -> Text:
    """One line per tier: agent count and what their caches take (warm: of the disk budget)."""
    warm_size = human_bytes(tiers.warm_bytes).rjust(9)
    if tiers.disk_budget_bytes:
        warm_size += f" of {human_bytes(tiers.disk_budget_bytes)}"
    if tiers.warm_kv_bits:
        warm_size += f", {tiers.warm_kv_bits}-bit"  # --kv-bits or --kv-bits-at-rest: new warm files are quantized
    # Discarded warm caches are how agents end up cold, so the count sits on the cold line.
    discarded = f"{tiers.discards_total:,} discarded" if tiers.discards_total else ""
    hot_size = human_bytes(tiers.hot_bytes).rjust(9)
    if tiers.hot_kv_bits and tiers.hot_token_bytes:
        # --kv-bits: the pool holds K/V packed, so its budget holds this many times the tokens.
        gain = tiers.full_token_bytes / tiers.hot_token_bytes
        hot_size += f", {tiers.hot_kv_bits}-bit ({gain:.1f}x tokens)"
    rows = (
        ("hot", tiers.hot_agents, hot_size),
        # Only where idle agents are quantized in memory (--kv-bits-at-rest): otherwise no such tier.
        *((("cool", tiers.cool_agents, f"{human_bytes(tiers.cool_bytes).rjust(9)}, {tiers.cool_kv_bits}-bit"),)
          if tiers.cool_kv_bits or tiers.cool_agents else ()),
        ("warm", tiers.warm_agents, warm_size),
        ("cold", tiers.cold_agents, discarded),
    )
    text = Text()
    for i, (tier, count, size) in enumerate(rows):
        text.append("\n" if i else "")
        text.append(f"{tier:<5}", style=TIER_STYLES[tier])
        text.append(f"{_agents(count):<10}{size}".rstrip())
    return text


def movement_lines(tiers: TierView) -> Text:
    """Each movement's rate (is the pool thrashing now?) next to its totals since start."""
    text = Text(f"evictions {tiers.evictions_per_min:.1f}/min ·")
    evicted = sorted(tiers.evictions_total.items(), key=lambda item: (EVICTION_ORDER.get(item[0], 3), item[0]))
    for tier, count in evicted:
        text.append(f" →{tier}", style=TIER_STYLES.get(tier, ""))
        text.append(f" {count:,}")
    if not evicted:
        text.append(" none", style=FREE_STYLE)
    text.append(f"\nrestores {tiers.restores_per_min:.1f}/min · {tiers.restores_total:,} total")
    return text


def hit_rate_line(tiers: TierView) -> Text:
    looked_up = tiers.prefix_hits + tiers.prefix_misses
    if not looked_up:
        text = Text("prefix cache hits –", style=FREE_STYLE)
    else:
        text = Text(f"prefix cache hits {tiers.prefix_hits / looked_up:.0%} ({tiers.prefix_hits:,} of {looked_up:,})")
        if tiers.shared_hits:
            text.append(f": {tiers.own_hits:,} own, {tiers.shared_hits:,} shared", style="dim")
    return text + shared_line(tiers)


def shared_line(tiers: TierView) -> Text:
    """Prefixes several agents share: blocks held by more than one agent, and the ones stored on disk."""
    if not tiers.shared_blocks and not tiers.prefix_files:
        return Text()
    text = Text("\nshared ")
    text.append(f"{tiers.shared_blocks:,} blocks in memory", style="bold")
    if tiers.prefix_files:
        text.append(f" · {tiers.prefix_files} prefix{'es' if tiers.prefix_files > 1 else ''} on disk "
                    f"({human_bytes(tiers.prefix_bytes)})")
    return text


class TiersPanel(Vertical):
    """Call ``update_snapshot`` at any rate: only lines whose text changed are redrawn."""

    DEFAULT_CSS = """
    TiersPanel { height: auto; }
    TiersPanel Static { text-wrap: nowrap; text-overflow: ellipsis; }
    TiersPanel #tiers-agents { height: auto; }
    TiersPanel #tiers-disk { height: 1; }
    TiersPanel #tiers-disk-label { width: 5; }
    TiersPanel #tiers-disk-bar { width: 1fr; }
    TiersPanel #tiers-disk-bar Bar { width: 1fr; }
    TiersPanel #tiers-disk-off { display: none; }
    TiersPanel #tiers-movement { height: 2; }
    TiersPanel #tiers-hits { height: 1; }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._shown: dict[str, Text] = {}
        self._disk: tuple[int, int] | None = None

    def compose(self) -> ComposeResult:
        yield Static(tier_lines(TierView()), id="tiers-agents")
        with Horizontal(id="tiers-disk"):
            yield Label("disk", id="tiers-disk-label")
            # No ETA: it reads a clock, and disk use is not a task heading to completion.
            yield ProgressBar(total=1, show_eta=False, id="tiers-disk-bar")
            yield Static("off (no disk budget)", id="tiers-disk-off")
        yield Static(movement_lines(TierView()), id="tiers-movement")
        yield Static(hit_rate_line(TierView()), id="tiers-hits")

    def update_snapshot(self, snapshot: EngineSnapshot) -> None:
        tiers = snapshot.tiers
        self._set("tiers-agents", tier_lines(tiers))
        self._set("tiers-movement", movement_lines(tiers))
        self._set("tiers-hits", hit_rate_line(tiers))
        self._set_disk(tiers.warm_bytes, tiers.disk_budget_bytes)

    def _set(self, widget_id: str, text: Text) -> None:
        if self._shown.get(widget_id) == text:
            return
        self._shown[widget_id] = text
        # Every line has a fixed height, so new text never needs a re-layout.
        self.query_one(f"#{widget_id}", Static).update(text, layout=False)

    def _set_disk(self, used: int, budget: int) -> None:
        if self._disk == (used, budget):
            return
        had_budget = self._disk is None or self._disk[1] > 0
        self._disk = (used, budget)
        bar = self.query_one("#tiers-disk-bar", ProgressBar)
        if budget > 0:
            bar.update(total=budget, progress=min(used, budget))
        if had_budget != (budget > 0):
            bar.display = budget > 0
            self.query_one("#tiers-disk-off", Static).display = budget <= 0
