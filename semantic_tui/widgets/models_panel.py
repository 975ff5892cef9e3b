"""The resident models (--extra-model): which are loaded, what each holds of the budget, what each serves.

Shown only when more than one model is configured; a one-model workbench
keeps its layout.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from ..agent_colors import FREE_STYLE, PRESSURE_CRITICAL, PRESSURE_CRITICAL_STYLE, PRESSURE_HIGH, PRESSURE_HIGH_STYLE
from ..formatting import human_bytes

STATE_STYLES = {"resident": "bold green", "loading": "yellow", "unloading": "yellow", "unloaded": "dim",
                "failed": "bold red"}
ALIAS_WIDTH = 12


def model_lines(rows: list[dict[str, Any]], budget: dict[str, int], shown: str | None = None) -> Text:
    """One line per configured model (default first), then the budget. ``shown``: the alias whose pool, tiers
    and throughput the side panes show (marked with a bar)."""
    text = Text()
    for row in rows:
        alias = str(row["alias"]).rstrip("/").rsplit("/", 1)[-1]  # a folder: its name
        alias = alias if len(alias) <= ALIAS_WIDTH else alias[: ALIAS_WIDTH - 1] + "…"
        marks = ("*" if row["default"] else "") + ("P" if row["pinned"] and not row["default"] else "") + \
            ("s" if row["role"] == "side" else "")
        text.append("▌" if row["alias"] == shown else " ", style="bold")
        text.append(f"{alias:<{ALIAS_WIDTH}} {marks:<2} ")
        state = str(row["state"])
        text.append(f"{state:<9}", style=STATE_STYLES.get(state, ""))
        if state == "resident":
            text.append(f" {human_bytes(int(row['weights_bytes'])):>8} + "
                        f"{human_bytes(int(row['kv_used_bytes']))}/{human_bytes(int(row['pool_bytes']))} KV")
            text.append(f" · {row['agents']} ag · {row['requests_routed']} req")
        elif row.get("error"):
            text.append(f" {str(row['error'])[:40]}", style=FREE_STYLE)
        text.append("\n")
    held, total = budget["held_bytes"], budget["budget_bytes"]
    share = held / total if total else 0.0
    style = PRESSURE_CRITICAL_STYLE if share >= PRESSURE_CRITICAL else PRESSURE_HIGH_STYLE if share >= PRESSURE_HIGH else ""
    text.append("budget ")
    text.append(f"{human_bytes(held)} of {human_bytes(total)}", style=style)
    text.append("  (* default, P pinned, s side; ▌ in the panes below)", style=FREE_STYLE)
    return text


class ModelsPanel(Static):
    DEFAULT_CSS = """
    ModelsPanel { height: auto; max-height: 8; }
    """

    def update_models(self, rows: list[dict[str, Any]], budget: dict[str, int], shown: str | None = None) -> None:
        self.update(model_lines(rows, budget, shown))
