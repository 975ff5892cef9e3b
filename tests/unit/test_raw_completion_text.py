"""How a raw completion's tokens become text: its first text keeps the leading blank mlx-lm's streaming
detokenizers drop, and a thinking model's tokens are read as plain text (no reasoning tracker)."""

from __future__ import annotations

from engine.domain.reasoning import Channel, Route
from engine.domain.requests import GenerationRequest
from engine.models.reasoning_format import reasoning_format
from engine.runtime.runner.leading_blank import LeadingBlankKept
from engine.runtime.runner.text_stream import TextStream
from engine.runtime.scheduler.turn_start import TurnStart
from tests.support.byte_tokenizer import EOS, ByteDetokenizer, ByteTokenizer
from tests.support.marker_tokenizer import MarkerTokenizer


class TrimmingDetokenizer(ByteDetokenizer):
    """Drops a leading blank while it has emitted nothing, as mlx-lm's BPE detokenizer does."""

    def __init__(self) -> None:
        super().__init__()
        self._emitted = False

    @property
    def last_segment(self) -> str:
        segment = ByteDetokenizer.last_segment.fget(self)  # type: ignore[attr-defined]
        if not self._emitted and segment.startswith(" "):
            segment = segment[1:]
        self._emitted = self._emitted or bool(segment)
        return segment


def stream_text(detokenizer, reply: str) -> str:
    stream = TextStream(detokenizer)
    text = "".join(stream.push(token).text for token in reply.encode())
    return text + stream.finish().text


def test_the_blank_comes_back_after_the_prompt() -> None:
    decode = ByteTokenizer().decode
    prompt = list(b"The primary colors are")
    assert stream_text(TrimmingDetokenizer(), " red, blue") == "red, blue"  # what a chat reply shows
    assert stream_text(LeadingBlankKept(TrimmingDetokenizer(), decode, prompt), " red, blue") == " red, blue"
    # Two blanks, both dropped (one a token): both come back.
    assert stream_text(LeadingBlankKept(TrimmingDetokenizer(), decode, prompt), "  x") == "  x"


def test_text_without_a_blank_and_a_detokenizer_that_keeps_it_are_left_alone() -> None:
    decode = ByteTokenizer().decode
    prompt = list(b"Count: 1, 2,")
    assert stream_text(LeadingBlankKept(TrimmingDetokenizer(), decode, prompt), "3, 4") == "3, 4"
    assert stream_text(LeadingBlankKept(ByteDetokenizer(), decode, prompt), " 3, 4") == " 3, 4"


def test_a_raw_completion_reads_a_thinking_models_tokens_as_plain_text() -> None:
    """Its markers stay in the text: no reasoning tracker, however the prompt ends; a chat turn gets one."""
    tokenizer = MarkerTokenizer()
    start = TurnStart(tokenizer, frozenset({EOS}), 64, grammars=object(),  # type: ignore[arg-type]
                      reasoning=reasoning_format(tokenizer))
    prompt = tuple(tokenizer.encode("Think first: <think>\n"))
    chat = GenerationRequest("a", prompt, 8)
    raw = GenerationRequest("a", prompt, 8, plain_text=True)
    assert start._reasoning(chat) is not None and start._reasoning(raw) is None
    text, _ = start.readers(raw)
    tokens = tokenizer.encode("plan</think> done", add_special_tokens=False)
    out = text.push((token, Route(Channel.ANSWER)) for token in tokens)
    assert out.text + text.finish().text == "plan</think> done"
