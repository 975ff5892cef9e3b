"""Position arithmetic of block runs: trimming, growth, sliding windows."""

from __future__ import annotations

from hypothesis import given, strategies as st

from engine.domain.block_layout import (
    BlockRef,
    Run,
    Span,
    block_spans,
    can_trim,
    common_prefix_length,
    plan_growth,
    trim_run,
)

B = 4


def run_of(start: int, end: int, first_id: int = 0) -> Run:
    spans = block_spans(start, end, B)
    return Run(tuple(BlockRef(first_id + i, s.start, s.length) for i, s in enumerate(spans)))


def test_block_spans_cut_on_absolute_boundaries() -> None:
    assert block_spans(0, 10, B) == [Span(0, 4), Span(4, 8), Span(8, 10)]
    assert block_spans(6, 13, B) == [Span(6, 8), Span(8, 12), Span(12, 13)]
    assert block_spans(5, 5, B) == []


def test_trim_keeps_a_partial_view_of_the_divergent_block() -> None:
    run, dropped = trim_run(run_of(0, 10), 6)
    assert [(r.block_id, r.start, r.length) for r in run.refs] == [(0, 0, 4), (1, 4, 2)]
    assert dropped == [2]


def test_global_growth_keeps_complete_blocks_and_rewrites_the_tail() -> None:
    cached, _ = trim_run(run_of(0, 10), 10)
    kept, spans = plan_growth(cached, 15, 0, None, B)
    assert kept.block_ids == [0, 1]
    assert spans == [Span(8, 12), Span(12, 15)]


def test_sliding_growth_drops_blocks_that_left_the_window() -> None:
    cached = run_of(0, 10)
    kept, spans = plan_growth(cached, 20, 14, 6, B)  # window 6: positions 14.. needed
    assert kept.block_ids == []
    assert spans == [Span(14, 16), Span(16, 20)]


def test_sliding_growth_reuses_old_blocks_when_they_bridge_the_gap() -> None:
    cached = run_of(2, 12)  # blocks [2,4) [4,8) [8,12)
    kept, spans = plan_growth(cached, 14, 6, 8, B)  # first needed position 6
    assert kept.block_ids == [1, 2]
    assert spans == [Span(12, 14)]


def test_sliding_trim_needs_the_whole_window_before_the_cut() -> None:
    run = run_of(8, 20)
    assert can_trim(run, 20, 12)  # needs 8..20: held
    assert not can_trim(run, 15, 12)  # needs 3..15: 3..8 is gone
    assert can_trim(run_of(0, 10), 5, 12)  # still inside the first window


@given(st.integers(0, 60), st.integers(0, 60), st.integers(0, 30), st.one_of(st.none(), st.integers(1, 20)))
def test_growth_plan_covers_exactly_what_the_next_step_needs(k: int, extra: int, slack: int, window: int | None) -> None:
    cached, _ = trim_run(run_of(0, k), k)
    n = k + extra
    lo = 0 if window is None else max(0, n - window)
    source_start = max(0, lo - slack) if window is not None else 0
    kept, spans = plan_growth(cached, n, source_start, window, B)
    refs = list(kept.refs) + [BlockRef(-1, s.start, s.length) for s in spans]
    if n == 0:
        assert refs == []
        return
    assert refs[0].start <= lo  # everything the next step attends to is held
    assert refs[-1].end == n
    assert all(a.end == b.start for a, b in zip(refs, refs[1:]))  # contiguous
    assert all(r.length <= B and (r.end - 1) // B == r.start // B for r in refs)  # within one block
    assert all(s.start >= source_start for s in spans)  # new data exists in the source


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length((1, 2), [1, 2, 3]) == 2


@given(
    shared=st.integers(0, 1500),
    tails=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    as_tuple=st.tuples(st.booleans(), st.booleans()),
)
def test_common_prefix_length_equals_the_token_by_token_answer(
    shared: int, tails: tuple[int, int], as_tuple: tuple[bool, bool]
) -> None:
    """Chunked comparison (long conversations) finds the same divergence as comparing one token at a time."""
    a = list(range(shared)) + [-1] * tails[0]
    b = list(range(shared)) + [-2] * tails[1]
    left, right = (tuple(a) if as_tuple[0] else a), (tuple(b) if as_tuple[1] else b)
    naive = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix_length(left, right) == naive == shared
