"""One colour per agent, the same in every widget, plus the pool map's fixed styles.

The colour comes from a hash of the agent id, not from an assignment table,
so the pool map and the agents table agree without sharing state, and an
agent keeps its colour across restarts.
"""

from __future__ import annotations

import zlib

# Mid-luminance, well-separated hues: each keeps enough contrast on a near-black
# and on a near-white background. Greys are left out so no agent looks free.
AGENT_PALETTE: tuple[str, ...] = (
    "#4e79a7",  # blue
    "#f28e2b",  # orange
    "#e15759",  # red
    "#17a2b8",  # cyan
    "#59a14f",  # green
    "#b8860b",  # dark gold
    "#9467bd",  # purple
    "#e377c2",  # pink
    "#9c755f",  # brown
    "#8c9e1e",  # olive
    "#5a5fd6",  # indigo
    "#c71585",  # magenta
)

FREE_STYLE = "dim"
"""Free blocks: dim so used blocks stand out whatever the theme's foreground."""

TIER_STYLES = {"hot": "bold red", "cool": "cyan", "warm": "yellow", "cold": "blue", "empty": "dim"}
"""Tier names, styled as the agents table styles them."""

PRESSURE_OK_STYLE = "#3fa34d"
PRESSURE_HIGH_STYLE = "#d4a106"
PRESSURE_CRITICAL_STYLE = "#e5484d"
PRESSURE_HIGH = 0.70
PRESSURE_CRITICAL = 0.90


def agent_color(agent_id: str) -> str:
    """A stable hex colour for ``agent_id``.

    crc32 rather than ``hash()``: Python salts str hashes per process, which
    would give an agent a new colour at every start.
    """
    return AGENT_PALETTE[zlib.crc32(agent_id.encode("utf-8")) % len(AGENT_PALETTE)]


def pressure_style(pressure: float) -> str:
    """Green below 70 % of the pool in use, yellow below 90 %, red above."""
    if pressure < PRESSURE_HIGH:
        return PRESSURE_OK_STYLE
    if pressure < PRESSURE_CRITICAL:
        return PRESSURE_HIGH_STYLE
    return PRESSURE_CRITICAL_STYLE
