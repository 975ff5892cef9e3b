"""Incremental text with stop strings: never emit part of a stop string, never lose text."""

from __future__ import annotations

from hypothesis import given, strategies as st

from engine.runtime.runner.text_stream import TextStream
from tests.support.byte_tokenizer import ByteDetokenizer


def feed(text: str, stops: tuple[str, ...]) -> tuple[list[str], str | None, str]:
    stream = TextStream(ByteDetokenizer(), stops)
    deltas = []
    for byte in text.encode():
        delta = stream.push(byte)
        deltas.append(delta.text)
        if delta.stop_sequence:
            return deltas, delta.stop_sequence, stream.text
    deltas.append(stream.finish().text)
    return deltas, None, stream.text


def test_multibyte_characters_are_emitted_whole() -> None:
    deltas, stop, text = feed("héllo → 世界", ())
    assert text == "héllo → 世界" and stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "世" in deltas and "界" in deltas


def test_stop_string_is_cut_and_never_emitted() -> None:
    deltas, stop, text = feed("Hello</s>world", ("</s>",))
    assert stop == "</s>" and text == "Hello"
    assert "".join(deltas) == "Hello"


def test_partial_stop_prefix_is_held_then_released() -> None:
    deltas, stop, text = feed("a<b and <c", ("<cut>",))
    assert stop is None and text == "a<b and <c"
    assert deltas[1] == "" and deltas[2] == "<b"  # "<" held until "b" rules the stop out


def test_earliest_of_several_stops_wins() -> None:
    _, stop, text = feed("xx STOP yy END", ("END", "STOP"))
    assert stop == "STOP" and text == "xx "


@given(st.text(max_size=40), st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_output_is_the_text_up_to_the_first_stop(text: str, stops: list[str]) -> None:
    _, stop, emitted = feed(text, tuple(stops))
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        assert stop is None and emitted == text
    else:
        at = min(i for i, _ in hits)
        assert stop is not None and emitted == text[:at]


# -- turn ends: a plain-format model starting the next speaker's paragraph -----------------------


def test_a_turn_end_cuts_the_text_and_reports_an_end_of_turn_not_a_stop_sequence() -> None:
    stream = TextStream(ByteDetokenizer(), (), ("\n\nUser:",))
    deltas = [stream.push(b) for b in "Paris.\n\nUser: and Rome?".encode()]
    ended = [d for d in deltas if d.ends_turn]
    assert ended and ended[0].stop_sequence is None
    assert stream.text == "Paris." and "".join(d.text for d in deltas) == "Paris."


def test_a_paragraph_that_only_starts_like_a_turn_end_is_released() -> None:
    stream = TextStream(ByteDetokenizer(), (), ("\n\nUser:",))
    deltas = [stream.push(b) for b in "a\n\nUsers may".encode()]
    deltas.append(stream.finish())
    assert not any(d.ends_turn for d in deltas) and stream.text == "a\n\nUsers may"


def test_a_client_stop_equal_to_a_turn_end_reports_as_the_clients() -> None:
    stream = TextStream(ByteDetokenizer(), ("\n\nUser:",), ("\n\nUser:", "\n\nSystem:"))
    deltas = [stream.push(b) for b in "ok\n\nUser:".encode()]
    assert deltas[-1].stop_sequence == "\n\nUser:" and not deltas[-1].ends_turn


def test_the_earlier_of_a_client_stop_and_a_turn_end_wins() -> None:
    stream = TextStream(ByteDetokenizer(), ("END",), ("\n\nUser:",))
    deltas = [stream.push(b) for b in "x\n\nUser: END".encode()]
    assert any(d.ends_turn for d in deltas) and stream.text == "x"
