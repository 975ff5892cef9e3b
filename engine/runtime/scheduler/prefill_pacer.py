"""How many prompt tokens a step may prefill, so that the step lasts about a target gap.

A step runs the prefill chunks it planned and then one decode token for every decoding row, so the gap
between two of a decoding agent's tokens is the whole step, and a turn that arrives meanwhile (a person's
warm turn among subagents' long prompts) waits for the step to end: a 512-token chunk of a long prompt on a
small CPU holds the machine for seconds. The pacer sizes each step's prefill to the target gap from what it
measures as the batch runs: a decode step's time (a moving average), and a prefill pass's cost as a line
through recent steps, a fixed part (reading the weights once) plus a part per prompt token, so the chunk is
the right size on a CPU, on Metal and on CUDA alike. Where a chunk rides the decode step's pass
(``SequenceBatch.board``: the CPU's host step), the fixed part is all but gone and the line says so. Where 512 tokens take less than the gap (a GPU), the
chunk is simply the full ``prefill_step_size``. When nobody would wait on the step (no agent decoding at the
prompt's level or above, no more urgent agent expected back: scheduler.py), prefill runs at the full
``prefill_step_size``; when only an agent expected back would wait, steps are kept shorter still
(``expected_gap_s``): nobody's token rate is at stake, only how long that turn waits for the step in flight.

The gap is ``decode_gap_ms`` when set; by default six decode steps, between 150 and 750 ms: a gap the eye
reads as a steady stream, and a step still long enough that a pass's fixed cost is a small share of it.
Under lockstep the ranks may not decide by their own clocks (scheduler.BatchHooks.timed): no pacing there.
"""

from __future__ import annotations

from collections import deque

DECODE_STEPS_PER_GAP = 6
GAP_FLOOR_S, GAP_CEILING_S = 0.15, 0.75
# The target before a decode step has been measured.
FIRST_GAP_S = 0.3
# Fewest prompt tokens a paced step carries, so a long prompt always moves at a rate the pass's fixed cost
# (reading the weights once) does not dominate.
MIN_CHUNK = 32
# Prompt tokens a step carries before the pacer has measured one.
FIRST_CHUNK = 64
SMOOTHING = 0.3
# Recent prefill steps the cost line is fitted over, and the spread of their sizes below which the fit is a
# plain ratio (too little spread to tell a pass's fixed cost from its per-token cost).
SAMPLES, MIN_SPREAD = 32, 8.0


class PrefillPacer:
    def __init__(self, decode_gap_ms: float | None, timed: bool) -> None:
        self.enabled = timed and decode_gap_ms != 0
        self._fixed_gap_s = None if decode_gap_ms is None else decode_gap_ms / 1000
        self.decode_s: float | None = None  # a decode-only step
        # (prompt tokens, seconds beyond the step's decode work) of recent steps that prefilled
        self._samples: deque[tuple[int, float]] = deque(maxlen=SAMPLES)

    @property
    def gap_s(self) -> float:
        """The target length of a step: the gap between two tokens of a decoding agent."""
        if self._fixed_gap_s is not None:
            return self._fixed_gap_s
        if self.decode_s is None:
            return FIRST_GAP_S
        return min(GAP_CEILING_S, max(GAP_FLOOR_S, DECODE_STEPS_PER_GAP * self.decode_s))

    @property
    def expected_gap_s(self) -> float:
        """The target length of a step that decodes nothing, paced only because a more urgent agent is expected
        back: its turn would wait for the step in flight, and no decoding agent's rate is at stake, so the step is
        kept to ``GAP_FLOOR_S`` (``decode_gap_ms`` when set). bench_agent_priority (SmolLM2, 2-core Sapphire
        Rapids, 3 repeats): the main turn's loaded/alone time to first token median 1.54x -> 1.22x at
        the floor, all agents' tok/s 0.89x -> 0.90x of priorities off."""
        return self._fixed_gap_s if self._fixed_gap_s is not None else GAP_FLOOR_S

    def observe(self, seconds: float, prefill_tokens: int, decode_rows: int) -> None:
        """One step took ``seconds``: it prefilled ``prefill_tokens`` and decoded ``decode_rows`` rows."""
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_s = _average(self.decode_s, seconds)
            return
        base = self.decode_s if decode_rows and self.decode_s is not None else 0.0
        self._samples.append((prefill_tokens, max(0.0, seconds - base)))

    def cost(self) -> tuple[float, float] | None:
        """(seconds a prefill pass costs whatever its size, seconds per prompt token) over recent steps."""
        if not self._samples:
            return None
        ns = [n for n, _ in self._samples]
        ts = [t for _, t in self._samples]
        mean_n, mean_t = sum(ns) / len(ns), sum(ts) / len(ts)
        var = sum((n - mean_n) ** 2 for n in ns) / len(ns)
        if var ** 0.5 >= MIN_SPREAD:
            per_token = sum((n - mean_n) * (t - mean_t) for n, t in self._samples) / len(ns) / var
            if per_token > 0:
                return max(0.0, mean_t - per_token * mean_n), per_token
        return 0.0, mean_t / mean_n

    def budget(self, ceiling: int, expected_only: bool = False) -> int:
        """Prompt tokens the next step may prefill (at most ``ceiling``) so that it lasts about ``gap_s`` beside
        the decode work of the rows decoding; ``expected_only``: nobody decodes and the step is paced only for a
        turn expected back (:meth:`expected_gap_s`)."""
        cost = self.cost()
        if cost is None:
            return min(ceiling, FIRST_CHUNK)
        fixed, per_token = cost
        room = self.expected_gap_s - fixed if expected_only else self.gap_s - fixed - (self.decode_s or 0.0)
        if per_token <= 0:
            return ceiling
        return max(min(MIN_CHUNK, ceiling), min(ceiling, int(room / per_token)))


def _average(previous: float | None, sample: float) -> float:
    return sample if previous is None else (1 - SMOOTHING) * previous + SMOOTHING * sample
