"""The crash harness (bench/crash.py), two rounds on the real SmolLM2: SIGKILL at a random moment under load,
restart, check; no round may find a violation.

Each round kills ``semantic --serve`` while direct, OpenAI and Anthropic agents take turns, fork, rewind,
export, import and get evicted, then restarts it on the same state directory and checks: it starts by itself,
no temporary file survives the start-up sweep, the warm files and the server's list agree within the disk
budget, no acknowledged turn of a direct agent is lost, and a sample of agents' next turns are token-identical
to a fresh prefill. Between two rounds the test also leaves a dead writer's temporary files in every folder a
writer uses (as a kill in the middle of each write would), which the restart must sweep.

Two rounds, not ten: each round runs every action (turns, fork, rewind, export, import, eviction) and every
check, and the second sweeps the files planted after the first, which is what the suite must prove; finding a
rare race needs hundreds of rounds, which is the harness's own job (``python -m bench.crash --rounds 200``,
kept in bench/reports/). The faults its long runs found have their own regression tests
(tests/unit/test_cache_file_crash.py, test_temp_files.py, test_warm_tier.py). Two rounds took 40 s here
(2026-12-03), four 83 s.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.crash import run

pytestmark = [pytest.mark.model, pytest.mark.solo(reason="kills at random moments of a server running flat out")]

ROUNDS = 2
# Where writers put temporary files: conversations, stored responses, the warm tier (cache files and the cold
# index), the cache root (exports and imports).
TEMP_HOMES = ("conversations", "responses", "agents", ".")


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.slow(reason="two kill-restart-check rounds, each a server start on the real model (~40 s here)")
def test_kills_at_random_moments_lose_nothing(smollm2_path: Path, tmp_path: Path) -> None:
    seed = random.randrange(2**31)
    planted: list[Path] = []
    pid = _dead_pid()

    def plant(round_no: int, state_dir: Path) -> None:
        for home in TEMP_HOMES:
            folder = state_dir / home
            if folder.is_dir():
                target = next((d for d in sorted(folder.rglob("*")) if d.is_dir() and "models" not in d.parts),
                              folder)
                path = target / f".left-by-a-kill-{round_no}.{pid}.abcd1234.tmp"
                path.write_bytes(b"half a file")
                planted.append(path)

    logs = tmp_path / "logs"
    logs.mkdir()
    tally = run(str(smollm2_path), ROUNDS, seed, tmp_path / "state", logs, after_kill=plant,
                progress=lambda line: print(line, flush=True))
    assert tally.rounds == ROUNDS
    assert not tally.violations, f"seed {seed}: " + "; ".join(
        f"round {v.round} {v.check}: {v.detail}" for v in tally.violations)
    assert planted and not any(p.exists() for p in planted)  # (the harness also checked no *.tmp survived)
    assert tally.checked_turns >= ROUNDS  # every round compared turns with a fresh prefill
    assert sum(tally.actions.values()) >= 2 * ROUNDS
