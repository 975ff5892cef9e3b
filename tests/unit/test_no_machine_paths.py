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
