"""The soak's RSS slope check (bench/server_probe.py): flat under a two-level alternation, steep under a leak."""

from __future__ import annotations

import pytest

from bench.server_probe import rss_level_slope_mb_per_min, rss_slope_mb_per_min

pytestmark = pytest.mark.unit


def samples(rss) -> list[tuple[float, float]]:
    """A 30-s second half sampled every 2 s, as the CI soak takes it."""
    return [(30.0 + 2 * i, rss(i)) for i in range(16)]


def alternating(i: int) -> float:
    # The CI soak's failing run (2026-11-27): 767.5 and 754.7 MiB by turns, idle end below idle start.
    return 767.5 if i % 3 != 1 else 754.7


def test_rss_that_alternates_between_two_levels_has_a_flat_level_slope() -> None:
    assert abs(rss_level_slope_mb_per_min(samples(alternating))) < 4.0


def test_the_failing_run_of_the_ci_soak_reads_flat() -> None:
    # Its samples from t = 31 s (half of 62 s of traffic): 19.38 MiB/min through them, against a limit of 16.
    second_half = [(32.3, 754.7), (34.3, 767.5), (36.3, 754.7), (38.3, 760.4), (40.3, 754.7),
                   (42.3, 767.5), (44.3, 754.8), (46.3, 754.7), (48.3, 766.3), (50.4, 767.9), (52.4, 767.8),
                   (54.4, 755.2), (56.4, 766.3), (58.4, 767.8), (60.4, 767.7)]
    assert rss_slope_mb_per_min(second_half) == pytest.approx(19.38, abs=0.01)
    assert abs(rss_level_slope_mb_per_min(second_half)) < 4.0


def test_the_run_whose_peaks_missed_the_upper_level_in_a_window_reads_flat() -> None:
    # The full run of 2026-11-28 (session 12): RSS alternated between ~860 and ~872 MiB, the upper level in
    # 7 of 31 samples; the second half's first 10 s held none, so its peaks read 22.42 MiB/min (limit 16).
    second_half = [(32.2, 861.1), (34.2, 860.0), (36.2, 861.2), (38.2, 860.0), (40.2, 860.0), (42.2, 872.3),
                   (44.3, 860.8), (46.3, 860.1), (48.3, 860.1), (50.3, 860.9), (52.3, 860.8), (54.3, 860.8),
                   (56.3, 860.1), (58.3, 871.8), (60.3, 865.4)]
    first = second_half[0][0]
    peaks = [max((s for s in second_half if int((s[0] - first) // 10) == w), key=lambda s: s[1]) for w in range(3)]
    assert rss_slope_mb_per_min(peaks) == pytest.approx(22.42, abs=0.3)
    assert abs(rss_level_slope_mb_per_min(second_half)) < 4.0


@pytest.mark.parametrize("leak_mb_per_min", [20.0, 60.0])
def test_a_leak_under_the_same_alternation_shows_in_the_level_slope(leak_mb_per_min: float) -> None:
    leaking = samples(lambda i: alternating(i) + leak_mb_per_min * (2 * i) / 60)
    assert rss_level_slope_mb_per_min(leaking) == pytest.approx(leak_mb_per_min, rel=0.35)
    assert rss_level_slope_mb_per_min(leaking) > 16
