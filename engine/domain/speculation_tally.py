"""What speculative decoding did for a turn, an agent or the engine: drafts verified, kept, and tokens per step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpeculationTally:
    drafted: int = 0  # drafted tokens the model verified
    accepted: int = 0  # of those, the ones it would have produced itself (kept)
    steps: int = 0  # speculative steps that verified drafts
    emitted: int = 0  # tokens those steps emitted (kept drafts and the model's own token after them)
    # Derived from the counts (whatever is passed is replaced), stored so that every JSON view shows them.
    acceptance: float = 0.0  # kept drafts over drafts verified (0 before any)
    tokens_per_step: float = 0.0  # tokens a speculative step emitted on average (plain decoding: 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "acceptance", round(self.accepted / self.drafted, 4) if self.drafted else 0.0)
        object.__setattr__(self, "tokens_per_step", round(self.emitted / self.steps, 3) if self.steps else 0.0)

    def __add__(self, other: "SpeculationTally") -> "SpeculationTally":
        return SpeculationTally(self.drafted + other.drafted, self.accepted + other.accepted,
                                self.steps + other.steps, self.emitted + other.emitted)
