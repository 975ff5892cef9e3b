"""A raw completion's first text with its leading blank.

mlx-lm's streaming detokenizers drop the first token's leading blank: a chat
reply starts a message of its own (" Paris" shows as "Paris"). A raw
completion continues its prompt mid-line, where that blank is part of the
text ("are" then " red"). This wrapper gives the first text the blank back,
found by decoding the first tokens after the prompt's last few, which works
the same for every detokenizer (BPE, SentencePiece, naive).
"""

from __future__ import annotations

from typing import Callable, Sequence

from engine.runtime.runner.text_stream import StreamingDetokenizer

# Prompt tokens decoded before the reply's first ones: enough for any tokenizer to join them as in the whole text.
CONTEXT_TOKENS = 8


class LeadingBlankKept:
    def __init__(self, inner: StreamingDetokenizer, decode: Callable[[list[int]], str],
                 prompt: Sequence[int]) -> None:
        self._inner = inner
        self._decode = decode
        self._context = list(prompt[-CONTEXT_TOKENS:])
        self._tokens: list[int] | None = []  # the reply's tokens until its first text (None: after it)

    def add_token(self, token: int) -> None:
        if self._tokens is not None:
            self._tokens.append(token)
        self._inner.add_token(token)

    def finalize(self) -> None:
        self._inner.finalize()

    @property
    def last_segment(self) -> str:
        segment = self._inner.last_segment
        if self._tokens is None or not segment:
            return segment
        tokens, self._tokens = self._tokens, None
        if segment[0].isspace():  # (a blank survived: nothing was dropped, or nothing can be told)
            return segment
        before = self._decode(self._context)
        whole = self._decode(self._context + tokens)
        if not whole.startswith(before):
            return segment
        whole = whole[len(before):]
        # The whole text is the blanks the detokenizer dropped, then its first text, then what it still holds.
        text = whole.lstrip()
        return whole[:len(whole) - len(text)] + segment if text.startswith(segment) else segment
