"""No tracked file names the checkout's own absolute path: scripts find the repository from ``__file__`` and
reports name files relative to it, so a clone anywhere reads and runs them alike."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_no_tracked_file_holds_this_checkouts_path() -> None:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode != 0:
        pytest.fail(f"git ls-files failed: {listed.stderr.decode()[-300:]}")
    here = str(ROOT).encode()
    holding = [name for name in listed.stdout.decode().split("\0")
               if name and (ROOT / name).is_file() and here in (ROOT / name).read_bytes()]
    assert holding == [], f"files naming {ROOT} (use a path relative to the repository): {holding}"


def test_reports_hold_data_and_the_code_cites_measurements_not_logs() -> None:
    """bench/reports/ keeps results (JSON, logs, PROVENANCE.md), never a copied script; and the product's code
    cites what was measured (tool, machine, date), not a report's file, which a later report moves on from."""
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "reports").rglob("*.py"))
    assert scripts == [], f"probe scripts in reports (make them a bench/ tool, or leave them to the history): {scripts}"
    citing = sorted(str(p.relative_to(ROOT)) for package in ("engine", "semantic_tui", "semantic_cli")
                    for p in (ROOT / package).rglob("*.py") if "bench/reports" in p.read_text())
    assert citing == [], f"code citing a report's path (cite the measurement): {citing}"
