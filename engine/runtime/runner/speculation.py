"""A speculative step's bookkeeping: which drafted tokens a sequence keeps, and what it has gained so far.

The batch feeds a sequence its last token and its drafts in one pass
(``backends``' ``verify``) and gets logits at every one of them: the
distribution of the token after the last token, after the first draft, and
so on. :func:`accepted_tokens` turns them into the tokens the sequence
emits this step: the drafts the model would have produced, then one token of
the model's own (the correction of the first draft it would not have
produced, or after all of them the next one), so a step emits one to
``drafts + 1`` tokens and never a token plain decoding would not.

Greedy rows keep drafts while each equals the argmax. Sampled rows use the
speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) for a
proposal that puts all its mass on the drafted token: keep draft ``d`` with
probability ``p(d)``; on a rejection draw from ``p`` without ``d``,
renormalized; after the last draft draw from ``p``. Each emitted token is
then distributed exactly as sampling from ``p`` is, where ``p`` is the
row's own filtered distribution (temperature, top-p, top-k: ``sampling.filtered``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from engine.domain.speculation_tally import SpeculationTally
from engine.runtime.runner.drafting import Drafter, DraftLength
from engine.runtime.runner.sampling import RowSampler, TopK, filtered, mlx_top_k


@dataclass(slots=True)
class Speculation:
    """One sequence's drafter, draft length, and its tally."""

    drafter: Drafter
    length: DraftLength
    tally: SpeculationTally = SpeculationTally()

    def verified(self, drafted: int, accepted: int, emitted: int) -> None:
        """A step verified ``drafted`` drafts, kept ``accepted`` and emitted ``emitted`` tokens."""
        self.length.taken(drafted, accepted)
        if drafted:
            self.tally = self.tally + SpeculationTally(drafted, accepted, 1, emitted)


def greedy_tokens(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """A greedy row's tokens: the drafts while each is the argmax (``targets``: the argmax at the last token and
    after each draft), then the argmax itself."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return [*drafts[:kept], targets[kept]]


def accepted_tokens(logits: mx.array, drafts: Sequence[int], sampler: RowSampler,
                    top_k: TopK = mlx_top_k) -> list[int]:
    """A sampled row's tokens: ``logits`` (len(drafts) + 1, vocabulary) at its last token and each draft."""
    params = sampler.params
    candidates, ids = filtered(logits, params.top_p, params.top_k, top_k)
    scaled = candidates.astype(mx.float32) * (1 / params.temperature)
    probs = np.asarray(mx.softmax(scaled, axis=-1))
    ids_np = None if ids is None else np.asarray(ids)
    draws = sampler.uniforms(2 * len(drafts) + 1)
    emitted: list[int] = []
    for j, draft in enumerate(drafts):
        p = probs[j]
        column = _column(ids_np, j, draft)
        chance = float(p[column]) if column is not None else 0.0
        if draws[2 * j] < chance:
            emitted.append(draft)
            continue
        if column is not None:
            p = p.copy()
            p[column] = 0.0
        emitted.append(_token(ids_np, j, _draw(p, draws[2 * j + 1])))
        return emitted
    emitted.append(_token(ids_np, len(drafts), _draw(probs[len(drafts)], draws[-1])))
    return emitted


def _column(ids: np.ndarray | None, row: int, token: int) -> int | None:
    """Where ``token`` sits among a row's candidates (None: filtered out, probability 0)."""
    if ids is None:
        return token
    where = np.nonzero(ids[row] == token)[0]
    return int(where[0]) if where.size else None


def _token(ids: np.ndarray | None, row: int, column: int) -> int:
    return column if ids is None else int(ids[row, column])


def _draw(p: np.ndarray, u: float) -> int:
    """The index the inverse CDF of ``p`` (not necessarily normalized) gives at ``u``."""
    cumulative = np.cumsum(p, dtype=np.float64)
    total = cumulative[-1]
    index = int(np.searchsorted(cumulative, u * total, side="right")) if total > 0 else int(np.argmax(p))
    index = min(index, len(p) - 1)
    while p[index] <= 0 and index > 0:  # (a draw exactly on a boundary before zero-probability tail)
        index -= 1
    return index
