"""The soak's RSS slope check (bench/server_probe.py): flat under a two-level alternation, steep under a leak."""

from __future__ import annotations

import pytest

from bench.server_probe import rss_peak_slope_mb_per_min, rss_slope_mb_per_min

pytestmark = pytest.mark.unit


def samples(rss) -> list[tuple[float, float]]:
    """A 30-s second half sampled every 2 s, as the CI soak takes it."""
    return [(30.0 + 2 * i, rss(i)) for i in range(16)]


def alternating(i: int) -> float:
    # The CI soak's failing run (2026-11-27): 767.5 and 754.7 MiB by turns, idle end below idle start.
    return 767.5 if i % 3 != 1 else 754.7


def test_rss_that_alternates_between_two_levels_has_a_flat_peak_slope() -> None:
    assert abs(rss_peak_slope_mb_per_min(samples(alternating))) < 4.0


def test_the_failing_run_of_the_ci_soak_reads_flat() -> None:
    # Its samples from t = 31 s (half of 62 s of traffic): 19.38 MiB/min through them, against a limit of 16.
    second_half = [(32.3, 754.7), (34.3, 767.5), (36.3, 754.7), (38.3, 760.4), (40.3, 754.7),
                   (42.3, 767.5), (44.3, 754.8), (46.3, 754.7), (48.3, 766.3), (50.4, 767.9), (52.4, 767.8),
                   (54.4, 755.2), (56.4, 766.3), (58.4, 767.8), (60.4, 767.7)]
    assert rss_slope_mb_per_min(second_half) == pytest.approx(19.38, abs=0.01)
    assert abs(rss_peak_slope_mb_per_min(second_half)) < 4.0


@pytest.mark.parametrize("leak_mb_per_min", [20.0, 60.0])
def test_a_leak_under_the_same_alternation_shows_in_the_peak_slope(leak_mb_per_min: float) -> None:
    leaking = samples(lambda i: alternating(i) + leak_mb_per_min * (2 * i) / 60)
    assert rss_peak_slope_mb_per_min(leaking) == pytest.approx(leak_mb_per_min, rel=0.35)
    assert rss_peak_slope_mb_per_min(leaking) > 16
