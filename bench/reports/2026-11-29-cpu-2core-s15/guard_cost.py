"""Per-token cost of the repetition guard: the former loop over every period (64 and 128) against the
current guard (work per earlier occurrence of the token), on SmolLM2 tokens of this repository's engine
source (ordinary code: many repeated tokens) and on random ids. Run: python guard_cost.py TOKENIZER_FOLDER."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from mlx_lm.tokenizer_utils import load  # noqa: E402

from engine.runtime.scheduler import repetition  # noqa: E402
from tests.unit.test_out_of_the_box import _reference_loop  # noqa: E402,F401  (the rules, for the record)


class LoopGuard:
    """The former guard: every period, every token."""

    def __init__(self, window: int, periods: int) -> None:
        self.window, self.periods, self.tokens = window, periods, []
        self.runs, self.matches = [0] * (periods + 1), [0] * (periods + 1)

    def push(self, token: int) -> None:
        tokens, runs, matches = self.tokens, self.runs, self.matches
        tokens.append(token)
        n = len(tokens)
        leaving = n - 1 - self.window
        for period in range(1, min(self.periods, n - 1) + 1):
            same = tokens[n - 1 - period] == token
            runs[period] = runs[period] + 1 if same else 0
            matches[period] += same
            if leaving >= period:
                matches[period] -= tokens[leaving] == tokens[leaving - period]


def per_token(make, tokens) -> float:
    best = float("inf")
    for _ in range(3):
        guard = make()
        started = time.perf_counter()
        for t in tokens:
            guard.push(t)
        best = min(best, (time.perf_counter() - started) / len(tokens))
    return best * 1e6


tokenizer = load(Path(sys.argv[1]))
root = Path(__file__).resolve().parents[3]
code = tokenizer.encode("".join(p.read_text() for p in sorted((root / "engine").rglob("*.py"))[:40]))[:20000]
import random  # noqa: E402
rng = random.Random(0)
noise = [rng.randrange(49152) for _ in range(20000)]
for name, tokens in (("engine source", code), ("random ids", noise)):
    print(f"{name} ({len(tokens)} tokens): loop over 64 periods {per_token(lambda: LoopGuard(512, 64), tokens):.1f} us, "
          f"over 128 {per_token(lambda: LoopGuard(512, 128), tokens):.1f} us, "
          f"current guard (128) {per_token(lambda: repetition.RepetitionGuard(512), tokens):.1f} us a token")
