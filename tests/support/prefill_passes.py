"""Recording the engine's prefill passes, so a test can see which rows shared a pass and how wide it was."""

from __future__ import annotations

import pytest

from engine.runtime.runner.batch import SequenceBatch


def record_prefill_passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int]]:
    """Every prompt chunk fed from now on, as (each row's real chunk length, the pass's width): a prefill pass's
    rows, or a chunk that rode a decode step's pass (``SequenceBatch.board``; its own length as the width)."""
    passes: list[tuple[list[int], int]] = []
    real = SequenceBatch._prefill_group
    real_alight = SequenceBatch.alight

    def recording(self, group, n, out):
        passes.append(([m for _, m in group], n))
        return real(self, group, n, out)

    def alighting(self, out):
        passes.extend(([m], m) for _, m in self._boarded)
        return real_alight(self, out)

    monkeypatch.setattr(SequenceBatch, "_prefill_group", recording)
    monkeypatch.setattr(SequenceBatch, "alight", alighting)
    return passes
