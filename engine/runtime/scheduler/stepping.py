"""What one step of the batch means for its turns: prefill progress, tokens turned into text, and each turn's
end (decided in turn_end.py).
"""

from __future__ import annotations

import logging
import time

from engine.domain.event_log import EventKind
from engine.domain.repetition import Loop
from engine.domain.requests import PrefillEvent, TokenEvent
from engine.runtime import clock
from engine.runtime.runner.step_output import PrefillProgress, StepOutput, TokenOut
from engine.domain.reasoning import ANSWER
from engine.runtime.runner.routed_text import RoutedDelta
from engine.runtime.runner.sequence import RowStop
from engine.runtime.scheduler.completion import Completion
from engine.runtime.scheduler.parts import SchedulerPart, SchedulerState
from engine.runtime.scheduler.turn import Turn
from engine.runtime.scheduler.turn_end import Ending, out_of_room, turn_end
from engine.settings import TurnSettings


class Stepping(SchedulerPart):
    def __init__(self, state: SchedulerState, completion: Completion, turns: TurnSettings) -> None:
        super().__init__(state)
        self.completion = completion
        self.turns = turns

    def apply(self, out: StepOutput) -> None:
        """A step's outputs, in the order the batch made them."""
        for progress in out.prefill:
            self._on_prefill(progress)
        for uid in out.out_of_room:
            turn = self.queues.running(uid)
            if turn is not None:
                self._end(turn, out_of_room(turn))
        for token in out.tokens:
            self._on_token(token)

    # -- prefill ---------------------------------------------------------------------------
    def _on_prefill(self, progress: PrefillProgress) -> None:
        turn = self.queues.running(progress.uid)
        if turn is None:
            return
        self.stats.prefill.add(progress.done - turn.prefill_done)
        turn.prefilled(progress.done)
        if turn.agent is not None:
            turn.agent.prefilled(progress.done)
        if turn.share_at and not turn.published and turn.reused + progress.done >= turn.share_at:
            self._publish_early(turn)
        self.delivery.emit(turn, PrefillEvent(turn.request_id, progress.done, progress.total + 1, turn.reused))

    def _publish_early(self, turn: Turn) -> None:
        """The prefill passed ``share_at``: offer the cache so far to waiting turns with the same prefix."""
        turn.shared_early()
        agent = turn.agent
        assert agent is not None and agent.kv is not None
        agent.holds(list(turn.request.prompt_tokens[:agent.kv.offset]), self.completion.model_key)
        self.hot.publish(agent)
        self.events.emit(EventKind.ADMIT, f"{agent.agent_id}: first {agent.kv.offset} prompt tokens shareable "
                         "before the turn ends", agent.agent_id)

    # -- tokens ----------------------------------------------------------------------------
    def _on_token(self, out: TokenOut) -> None:
        turn = self.queues.running(out.uid)
        if turn is None:
            return
        self._mark_first_token(turn)
        self._meter_gap(turn)
        self.stats.decode.add(1)
        delta = self._decode(turn, out)
        if not _ends_with_stop_token(out) or not delta.empty:
            self.delivery.emit(turn, TokenEvent(turn.request_id, out.token, delta.text, delta.reasoning,
                                                tuple(delta.calls)))
        loop = turn.guard.push(out.token) if out.stop is None else None
        if loop is not None and _steered_closed(turn, loop):
            loop = None  # a constrained reply goes on, to its shortest valid end
        started = turn.first_token_tick
        ending = turn_end(turn, out, delta, loop, None if started is None else clock.now() - started,
                          self.turns.max_output_seconds)
        if ending is not None:
            self._end(turn, ending)

    def _end(self, turn: Turn, ending: Ending) -> None:
        if ending.note is not None:  # the server, not the model or the request, ended it: log why
            self.events.emit(EventKind.FINISH, f"{turn.request.agent_id}: {ending.note}", turn.request.agent_id,
                             logging.WARNING)
        self.completion.complete(turn, ending.reason, note=ending.note, stop_sequence=ending.stop_sequence)

    def _meter_gap(self, turn: Turn) -> None:
        gap = turn.token(time.monotonic())
        if gap is not None:
            self.stats.of_class(turn.request.agent_class.value).gaps.add(gap)

    def _mark_first_token(self, turn: Turn) -> None:
        if turn.first_token_at is not None:
            return
        self.stats.prefill.add(turn.to_prefill - turn.prefill_done)
        turn.first_token(clock.now())
        assert turn.first_token_at is not None
        self.stats.ttft.add(turn.first_token_at - turn.submitted_at)
        meter = self.stats.of_class(turn.request.agent_class.value)
        meter.ttft.add(turn.first_token_at - turn.submitted_at)
        meter.turns += 1
        if turn.agent is not None:
            turn.agent.decoding(turn.to_prefill)

    def _decode(self, turn: Turn, out: TokenOut) -> RoutedDelta:
        """The token as text, on its route (stop strings held back until they can be told apart); the end of the
        turn flushes what every route still holds."""
        assert turn.text is not None
        if out.released is not None:
            released = out.released
        else:  # no reasoning format: every token is the answer's, but the end-of-sequence token is not text
            released = () if _ends_with_stop_token(out) else ((out.token, ANSWER),)
        delta = turn.text.push(released)
        if out.stop is not None and delta.stop_sequence is None and not delta.ends_turn:
            reasoning = turn.sequence.reasoning if turn.sequence is not None else None
            if reasoning is not None:
                _merge(delta, turn.text.push(reasoning.flush()))
            _merge(delta, turn.text.finish())
        return delta


def _merge(delta: RoutedDelta, more: RoutedDelta) -> None:
    delta.text += more.text
    delta.reasoning += more.reasoning
    delta.calls.extend(more.calls)
    delta.stop_sequence = delta.stop_sequence or more.stop_sequence
    delta.ends_turn = delta.ends_turn or more.ends_turn


def _steered_closed(turn: Turn, loop: Loop) -> bool:
    """The server's guard found a loop in a constrained reply that is not whole: steer it closed instead of cutting it
    (once; a loop found again while it closes cuts it)."""
    constraint = turn.sequence.constraint if turn.sequence is not None else None
    return constraint is not None and constraint.close(f"repetition guard: {loop.describe()}")


def _ends_with_stop_token(out: TokenOut) -> bool:
    """The token is an end-of-sequence token: not text. (The token that completes a constrained reply is.)"""
    return out.stop is RowStop.END_TOKEN
