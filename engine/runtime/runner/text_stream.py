"""Token ids in, text deltas out: incremental detokenization plus stop strings.

Stop strings are matched on text, not tokens, because a stop string can be
tokenized differently inside generated text than on its own. Text that could
still turn out to be the start of a stop string is held back until it is
disambiguated, so a client never sees part of a stop sequence.

Turn ends are stop strings the client did not ask for: where a prompt format
without a chat template marks the next speaker (``\n\nUser:``), a base model
that keeps writing the dialogue has finished its reply. They cut the text the
same way but report an ordinary end of turn, not a stop sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class StreamingDetokenizer(Protocol):
    def add_token(self, token: int) -> None: ...
    def finalize(self) -> None: ...
    @property
    def last_segment(self) -> str: ...


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    stop_sequence: str | None = None  # a client's stop string ended the text here
    ends_turn: bool = False  # a turn end (a format's next-speaker marker) ended it


class TextStream:
    def __init__(self, detokenizer: StreamingDetokenizer, stop_strings: tuple[str, ...] = (),
                 turn_ends: tuple[str, ...] = ()) -> None:
        self._detok = detokenizer
        self._client_stops = frozenset(s for s in stop_strings if s)
        # The client's first: at one position the earlier-listed string wins (_find_stop).
        self._stops = tuple(s for s in dict.fromkeys([*stop_strings, *turn_ends]) if s)
        self._pending = ""
        self._stopped: str | None = None
        self.text = ""  # everything emitted so far

    @property
    def stopped(self) -> str | None:
        return self._stopped

    def push(self, token: int) -> TextDelta:
        """Feed one generated token; returns the text that is now safe to emit."""
        if self._stopped is not None:
            return self._stop_delta("", self._stopped)
        self._detok.add_token(token)
        return self._release(self._detok.last_segment, final=False)

    def finish(self) -> TextDelta:
        """Flush what the detokenizer still holds (e.g. at end of sequence)."""
        if self._stopped is not None:
            return TextDelta("")
        self._detok.finalize()
        return self._release(self._detok.last_segment, final=True)

    def _release(self, segment: str, final: bool) -> TextDelta:
        self._pending += segment
        hit = self._find_stop()
        if hit is not None:
            at, stop = hit
            out, self._pending, self._stopped = self._pending[:at], "", stop
            self.text += out
            return self._stop_delta(out, stop)
        keep = 0 if final else self._held_suffix_len()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return TextDelta(out)

    def _stop_delta(self, text: str, stop: str) -> TextDelta:
        # A string that is both a client's stop and a turn end reports as the client's.
        if stop in self._client_stops:
            return TextDelta(text, stop)
        return TextDelta(text, ends_turn=True)

    def _find_stop(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _held_suffix_len(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest
