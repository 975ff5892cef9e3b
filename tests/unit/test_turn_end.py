"""Why a turn ends, decided in one place (runtime/scheduler/turn_end.py), and what each reason tells clients."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.domain.requests import FinishReason, LoopClosed
from engine.runtime.runner.routed_text import RoutedDelta
from engine.runtime.runner.sequence import RowStop
from engine.runtime.runner.step_output import TokenOut
from engine.domain.repetition import Loop
from engine.runtime.scheduler.turn_end import out_of_room, turn_end

pytestmark = pytest.mark.unit


def _turn(constraint=None, cancel=None, loop_closed=None):
    return SimpleNamespace(sequence=SimpleNamespace(constraint=constraint), cancel_reason=cancel,
                           loop_closed=loop_closed)


WHOLE = SimpleNamespace(accepting=True)
OPEN = SimpleNamespace(accepting=False)  # a constrained reply whose JSON is not whole yet


def test_a_token_with_no_reason_to_end_goes_on() -> None:
    assert turn_end(_turn(), TokenOut(1, 5), RoutedDelta("x"), None, 0.1, 30.0) is None
    assert turn_end(_turn(), TokenOut(1, 5), RoutedDelta("x"), None, 31.0, 0.0) is None  # 0: no time limit


@pytest.mark.parametrize(("stop", "finish"), [(RowStop.END_TOKEN, FinishReason.STOP),
                                              (RowStop.FORMAT_WHOLE, FinishReason.COMPLETE),
                                              (RowStop.TOKEN_LIMIT, FinishReason.LENGTH)])
def test_what_the_token_settles_for_the_row_becomes_the_turns_finish_here(stop: RowStop,
                                                                           finish: FinishReason) -> None:
    assert turn_end(_turn(WHOLE), TokenOut(1, 5, stop), RoutedDelta(), None, 0.1, 30.0).reason is finish


def test_a_row_the_pool_could_not_grow_ends_for_capacity_with_the_pools_note() -> None:
    ending = out_of_room(SimpleNamespace(room_note="the pool holds 3 pinned agents"))
    assert (ending.reason, ending.note) == (FinishReason.CAPACITY, "the pool holds 3 pinned agents")
    assert ending.reason.outcome == "length"


def test_a_reply_steered_closed_from_a_loop_completes_with_a_note_saying_where() -> None:
    closed = LoopClosed(at_token=40, why="an array repeating its items", tokens_left=180)
    ending = turn_end(_turn(WHOLE, loop_closed=closed), TokenOut(1, 5, RowStop.FORMAT_WHOLE), RoutedDelta(), None,
                      0.1, 30.0)
    assert ending.reason is FinishReason.COMPLETE and ending.reason.outcome == "stop"
    assert ending.note == closed.describe() and "after 40 tokens" in ending.note and "180 of max_tokens" in ending.note
    called = turn_end(_turn(WHOLE, loop_closed=closed), TokenOut(1, 5, RowStop.END_TOKEN), RoutedDelta(), None, 0, 0)
    assert called.note == closed.describe()  # a tool call whose grammar ends on the end-of-sequence token
    capped = turn_end(_turn(OPEN, loop_closed=closed), TokenOut(1, 5, RowStop.TOKEN_LIMIT), RoutedDelta(), None, 0, 0)
    assert capped.reason is FinishReason.LENGTH and capped.note is None  # closing did not fit: length, as before


def test_a_stop_string_or_a_turn_end_in_the_text_wins_over_the_tokens_finish() -> None:
    stop = turn_end(_turn(), TokenOut(1, 5, RowStop.TOKEN_LIMIT), RoutedDelta("a", stop_sequence="END"), None, 0, 0)
    assert (stop.reason, stop.stop_sequence, stop.note) == (FinishReason.STOP_SEQUENCE, "END", None)
    ended = turn_end(_turn(), TokenOut(1, 5), RoutedDelta("a", ends_turn=True), None, 0, 0)
    assert ended.reason is FinishReason.TURN_END and ended.reason.outcome == "stop"


def test_the_servers_guards_end_it_with_a_note_and_a_cancel_before_them() -> None:
    loop = Loop(period=1, span=64)
    repeated = turn_end(_turn(), TokenOut(1, 5), RoutedDelta("a"), loop, 0.1, 30.0)
    assert repeated.reason is FinishReason.REPETITION and "cycle of 1 token" in repeated.note
    timed = turn_end(_turn(), TokenOut(1, 5), RoutedDelta("a"), None, 30.0, 30.0)
    assert timed.reason is FinishReason.TIME_LIMIT and "max_output_seconds" in timed.note
    cancelled = turn_end(_turn(cancel=FinishReason.CANCELLED), TokenOut(1, 5), RoutedDelta("a"), loop, 31, 30)
    assert cancelled.reason is FinishReason.CANCELLED


@pytest.mark.parametrize("cut", ["stop string", "loop", "dead end"])
def test_a_constrained_reply_cut_before_its_value_is_whole_reports_truncation(cut: str) -> None:
    delta = RoutedDelta('{"a', stop_sequence="X" if cut == "stop string" else None)
    out = TokenOut(1, 5, RowStop.END_TOKEN if cut == "dead end" else None)
    ending = turn_end(_turn(OPEN), out, delta, Loop(1, 64) if cut == "loop" else None, 0.1, 30.0)
    assert ending.reason is FinishReason.FORMAT_CUT and ending.reason.outcome == "length"
    assert "JSON was cut short" in ending.note
    # max_tokens on an open value is already a truncation of its own.
    assert turn_end(_turn(OPEN), TokenOut(1, 5, RowStop.TOKEN_LIMIT), RoutedDelta(), None, 0, 0).reason \
        is FinishReason.LENGTH


def test_each_reason_tells_clients_one_of_five_outcomes() -> None:
    outcomes = {reason: reason.outcome for reason in FinishReason}
    assert {r for r, o in outcomes.items() if o == "length"} == {
        FinishReason.LENGTH, FinishReason.TIME_LIMIT, FinishReason.FORMAT_CUT, FinishReason.CAPACITY}
    assert {r for r, o in outcomes.items() if o == "stop"} == {
        FinishReason.STOP, FinishReason.COMPLETE, FinishReason.TURN_END, FinishReason.REPETITION}
    assert outcomes[FinishReason.STOP_SEQUENCE] == "stop_sequence"
    assert (outcomes[FinishReason.CANCELLED], outcomes[FinishReason.ERROR]) == ("cancelled", "error")
