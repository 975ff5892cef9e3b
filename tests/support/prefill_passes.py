"""Recording the engine's prefill passes, so a test can see which rows shared a pass and how wide it was."""

from __future__ import annotations

import pytest

from engine.runtime.runner.batch import SequenceBatch


def record_prefill_passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int]]:
    """Every prefill pass from now on, as (each row's real chunk length, the pass's width)."""
    passes: list[tuple[list[int], int]] = []
    real = SequenceBatch._prefill_group

    def recording(self, group, n, out):
        passes.append(([m for _, m in group], n))
        return real(self, group, n, out)

    monkeypatch.setattr(SequenceBatch, "_prefill_group", recording)
    return passes
