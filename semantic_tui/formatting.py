"""Human-readable numbers for the workbench."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def relative_time(then: float, now: float) -> str:
    """Coarse on purpose: a label that changes every second redraws the whole table every second."""
    seconds = max(0.0, now - then)
    if seconds < 10:
        return "now"
    if seconds < 60:
        return "<1m"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f}h ago"
    return f"{seconds // 86400:.0f}d ago"
