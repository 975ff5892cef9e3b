"""Why a turn ends with the token just read, decided in one place.

The batch says what the token itself settles (runner/sequence.py ``RowStop``:
an end-of-sequence token, an output format that is whole, ``max_tokens``), as
facts: it stops launching the row at once, and only here do they become a
finish reason. The text says the rest (a stop string, the chat format's
next-speaker marker); the server adds its own guards (the repetition guard, ``max_output_seconds``)
and a client's cancel. Their order is the precedence: a constrained reply cut
before its value is whole reports truncation whatever cut it; a stop string
or a turn end in the text wins over the token's own finish, which it came
with; then the batch's reason, a cancel, a loop, the time.

A constrained reply found looping is not ended here but steered to its
shortest valid end (stepping.py, grammar/loop_closing.py); the finish that
completes it carries a note saying so. A row the pool could not grow ends
here too (``out_of_room``); what ends a turn before it has a token (a cancel
in the queue, an admission error) is the scheduler's, not a turn's end.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.domain.requests import FinishReason
from engine.runtime.runner.routed_text import RoutedDelta
from engine.runtime.runner.sequence import RowStop
from engine.runtime.runner.step_output import TokenOut
from engine.domain.repetition import Loop
from engine.runtime.scheduler.turn import Turn


@dataclass(frozen=True, slots=True)
class Ending:
    reason: FinishReason
    # Why the server ended it when the model and the request did not (logged as a warning, sent as the note).
    note: str | None = None
    stop_sequence: str | None = None


def turn_end(turn: Turn, out: TokenOut, delta: RoutedDelta, loop: Loop | None, generating_s: float | None,
             max_output_seconds: float) -> Ending | None:
    """How ``turn`` ends with ``out`` (None: it goes on). ``delta``: the token's text; ``loop``: what the
    repetition guard found; ``generating_s``: seconds since the first token."""
    text_ends = delta.stop_sequence is not None or delta.ends_turn
    if _format_cut(turn, out, text_ends or loop is not None):
        why = (f"repetition guard: {loop.describe()}" if loop is not None else
               "a stop sequence or end of turn" if text_ends else "the schema allowed no further token")
        return Ending(FinishReason.FORMAT_CUT, f"the reply's JSON was cut short ({why})")
    if delta.stop_sequence is not None:
        return Ending(FinishReason.STOP_SEQUENCE, stop_sequence=delta.stop_sequence)
    if delta.ends_turn:
        return Ending(FinishReason.TURN_END)
    if out.stop is not None:
        # (a tool call's grammar may end with the model's end-of-sequence token rather than complete)
        closed = turn.loop_closed if out.stop is not RowStop.TOKEN_LIMIT else None
        return Ending(_ROW_STOP_FINISH[out.stop], closed.describe() if closed is not None else None)
    if turn.cancel_reason is not None:
        return Ending(turn.cancel_reason)
    if loop is not None:
        return Ending(FinishReason.REPETITION, f"ended by the repetition guard: {loop.describe()}")
    if max_output_seconds > 0 and generating_s is not None and generating_s >= max_output_seconds:
        # Ended as max_tokens would, before the client's own timeout does.
        return Ending(FinishReason.TIME_LIMIT,
                      f"ended after {max_output_seconds:g} s of generating (max_output_seconds)")
    return None


def out_of_room(turn: Turn) -> Ending:
    """How a turn ends whose row the pool could not grow for its next token."""
    return Ending(FinishReason.CAPACITY, turn.room_note)


_ROW_STOP_FINISH = {RowStop.END_TOKEN: FinishReason.STOP, RowStop.FORMAT_WHOLE: FinishReason.COMPLETE,
                    RowStop.TOKEN_LIMIT: FinishReason.LENGTH}


def _format_cut(turn: Turn, out: TokenOut, cut: bool) -> bool:
    """A constrained reply is about to end before its output format is a whole value: cut by the text or a
    loop (``cut``), or by an end-of-sequence token its grammar forced at a dead end. (``max_tokens`` is
    reported as truncation already.)"""
    constraint = turn.sequence.constraint if turn.sequence is not None else None
    ending = cut or out.stop is RowStop.END_TOKEN
    return (ending and out.stop is not RowStop.TOKEN_LIMIT and constraint is not None
            and not constraint.accepting)
