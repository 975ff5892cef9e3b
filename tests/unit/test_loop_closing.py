"""A constrained reply that loops is steered to its shortest valid end (grammar/loop_closing.py, json_shape.py).

A scripted generator stands in for the model: it writes the bytes of its script while the grammar allows them
and, where the mask forbids the byte it wants, the allowed byte its script ranks first (it keeps trying to
loop). The byte tokenizer makes every byte a token, so the script is exactly what the grammar reads.
"""

from __future__ import annotations

import itertools
import json
from typing import Iterable, Iterator

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.domain.output_format import OutputFormat
from engine.grammar.json_shape import JsonShape
from engine.grammar.output_grammars import OutputGrammars
from engine.grammar.token_constraint import EXACT_WINDOW, TokenConstraint
from tests.support.byte_tokenizer import EOS, ByteTokenizer

pytestmark = pytest.mark.unit

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"note": {"type": "string"}, "stars": {"type": "integer"}},
        "required": ["note", "stars"], "additionalProperties": False}
GRAMMARS = OutputGrammars(ByteTokenizer(), [EOS])


def constraint(schema: dict, close_loops: bool = True) -> TokenConstraint:
    grammars = GRAMMARS if close_loops else OutputGrammars(ByteTokenizer(), [EOS], close_loops=False)
    return grammars.start(OutputFormat.from_schema(schema))


def write(c: TokenConstraint, script: Iterable[int], limit: int, budget: bool = False) -> bytes:
    """Generate under ``c`` until it is complete or ``limit`` tokens: the script's next byte where allowed, else the
    allowed byte the script ranks first (its bytes in order of first use), else the lowest allowed. ``budget``:
    ``limit`` is the turn's max_tokens, told to the constraint after each token as the engine's sequence does."""
    wants: Iterator[int] = iter(script)
    ranked: list[int] = []
    out = bytearray()
    for want in wants:
        if want not in ranked:
            ranked.append(want)
        allowed = set(np.nonzero(np.unpackbits(c.allowed().view(np.uint8), bitorder="little"))[0].tolist())
        token = want if want in allowed else next((t for t in ranked if t in allowed), min(allowed))
        if token == EOS:
            break
        c.consume(token)
        out.append(token)
        if c.complete or len(out) >= limit:
            break
        if budget:
            c.near_limit(limit - len(out))
    return bytes(out)


def looping(head: bytes, cycle: bytes) -> Iterator[int]:
    return itertools.chain(head, itertools.cycle(cycle))


def test_an_array_repeating_its_items_closes_after_the_repeats_and_validates() -> None:
    c = constraint(TAGS)
    text = write(c, looping(b'{"tags": ["dog", "cat", ', b'"cat", '), limit=400)
    reply = json.loads(text)
    jsonschema.validate(reply, TAGS)
    assert reply == {"tags": ["dog", "cat", "cat", "cat", "cat"]}  # closed at the third repeat, no item added
    assert c.complete and c.closed is not None and "repeating its items" in c.closed.why
    assert c.closed.at_token < len(text)


def test_items_whose_counter_moves_on_are_one_item_repeated() -> None:
    c = constraint(TAGS)
    script = itertools.chain(b'{"tags": [', itertools.chain.from_iterable(
        f'"step-{i}.json", '.encode() for i in itertools.count(1)))
    reply = json.loads(write(c, script, limit=600))
    assert reply["tags"] == [f"step-{i}.json" for i in range(1, 6)]  # four repeats once folded: a counter
    assert c.closed is not None


def test_objects_whose_counter_moves_on_close_after_six_repeats_and_data_with_versions_does_not() -> None:
    team = {"type": "object", "properties": {"members": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "role": {"enum": ["dev", "manager"]}},
        "required": ["name", "role"], "additionalProperties": False}}}, "required": ["members"],
        "additionalProperties": False}
    c = constraint(team)
    script = itertools.chain(b'{"members": [{"name": "Ann", "role": "dev"}, ', itertools.chain.from_iterable(
        f'{{"name": "Team{i}", "role": "manager"}}, '.encode() for i in itertools.count(1)))
    reply = json.loads(write(c, script, limit=2000))
    # closed before the seventh repeat's brace: no item after it
    assert [m["name"] for m in reply["members"]] == ["Ann", *(f"Team{i}" for i in range(1, 8))] and c.closed
    classifiers = constraint({"type": "array", "items": {"type": "object"}})
    versions = b"[" + b", ".join(f'{{"name": "classifier", "value": "Python :: 3.{v}"}}'.encode()
                                for v in range(8, 13)) + b', {"name": "license", "value": "MIT"}]'
    assert write(classifiers, versions, limit=len(versions)) == versions and classifiers.closed is None


def test_short_strings_counting_need_sixteen_repeats_and_a_number_written_on_ends_at_a_separator() -> None:
    c = constraint(TAGS)
    script = itertools.chain(b'{"tags": [', itertools.chain.from_iterable(
        f'"{i}", '.encode() for i in itertools.count(1)))
    assert json.loads(write(c, script, limit=2000))["tags"] == [str(i) for i in range(1, 18)] and c.closed
    count_first = {"type": "object", "properties": {"count": {"type": "integer"}, "name": {"type": "string"}},
                   "required": ["count", "name"], "additionalProperties": False}
    c = constraint(count_first)
    reply = json.loads(write(c, looping(b'{"count": 1', b"0"), limit=400))
    assert reply["name"] == "" and str(reply["count"]).startswith("10000") and c.closed  # not one more digit


def test_a_string_repeating_itself_closes_once_its_cycle_fills_the_exact_window() -> None:
    c = constraint(NOTE)
    text = write(c, looping(b'{"note": "', b"la"), limit=600)
    reply = json.loads(text)
    jsonschema.validate(reply, NOTE)
    assert reply["note"].startswith("lala") and set(reply["note"]) == {"l", "a"}
    assert EXACT_WINDOW // 2 <= len(reply["note"]) <= EXACT_WINDOW  # noticed after half the window repeats
    assert reply["stars"] == 0  # the shortest value the schema allows for what was still required
    assert c.closed is not None and "cycle of 2 tokens" in c.closed.why


def test_whitespace_written_on_and_on_closes_the_same_way() -> None:
    c = constraint(NOTE)
    reply = json.loads(write(c, looping(b'{"note": "ok', b" "), limit=600))
    assert reply["note"].startswith("ok   ") and reply["note"].strip() == "ok"
    assert c.closed is not None


def test_a_reply_that_cannot_close_in_the_tokens_left_stays_open() -> None:
    long_note = {"type": "object", "properties": {"note": {"type": "string", "minLength": 300}},
                 "required": ["note"], "additionalProperties": False}
    c = constraint(long_note)
    text = write(c, looping(b'{"note": "', b"la"), limit=200)
    assert len(text) == 200 and c.closed is not None and not c.complete  # the engine reports it as length
    assert not c.accepting


def words_never_repeating() -> Iterator[int]:
    """An array of items no guard matches (each a new word), written on and on: a sampled model's near loop."""
    yield from b'{"tags": ['
    for i in itertools.count():
        yield from f'"{chr(97 + i % 26) * (1 + i % 5)}{chr(97 + (i * 7) % 26)}{i * 37 % 101}", '.encode()


def test_a_reply_that_would_run_to_max_tokens_unclosed_closes_before_the_cap() -> None:
    c = constraint(TAGS)
    text = write(c, words_never_repeating(), limit=160, budget=True)
    reply = json.loads(text)
    jsonschema.validate(reply, TAGS)
    assert c.complete and len(text) < 160 and len(reply["tags"]) > 5
    assert c.closed is not None and c.closed.kind == "token_limit" and "tokens were left" in c.closed.why
    assert "before max_tokens cut it" in c.closed.describe()


def test_without_the_budget_the_same_reply_runs_to_the_cap() -> None:
    c = constraint(TAGS)
    text = write(c, words_never_repeating(), limit=160)
    assert len(text) == 160 and c.closed is None and not c.complete


def test_a_reply_whose_end_cannot_fit_before_the_cap_still_ends_there() -> None:
    long_note = {"type": "object", "properties": {"note": {"type": "string", "minLength": 300}},
                 "required": ["note"], "additionalProperties": False}
    c = constraint(long_note)
    counting = itertools.chain.from_iterable(str(i).encode() for i in itertools.count())  # no cycle to find
    text = write(c, itertools.chain(b'{"note": "', counting), limit=200, budget=True)
    assert len(text) == 200 and not c.complete  # the engine reports it as length, as before
    assert c.closed is not None and c.closed.kind == "token_limit"


def test_with_closing_off_the_loop_runs_on() -> None:
    c = constraint(TAGS, close_loops=False)
    text = write(c, looping(b'{"tags": ["dog", ', b'"cat", '), limit=300)
    assert len(text) == 300 and c.closed is None and not c.complete


def test_data_that_repeats_as_data_does_is_left_alone() -> None:
    rgb = {"type": "object", "properties": {"rgb": {"type": "array", "items": {"type": "integer"}},
                                            "points": {"type": "array", "items": {"type": "object"}},
                                            "words": {"type": "array", "items": {"type": "string"}},
                                            "versions": {"type": "array", "items": {"type": "string"}}},
           "required": ["rgb", "points", "words", "versions"], "additionalProperties": False}
    c = constraint(rgb)
    whole = (b'{"rgb": [0, 0, 0, 0, 0, 0, 0, 0], "points": [{"x": 1}, {"x": 2}, {"x": 3}, {"x": 4}], '
             b'"words": ["a", "b", "a", "c", "b", "d", "e"], "versions": ["3.9", "3.10", "3.11", "3.12", "3.13"]}')
    assert write(c, whole, limit=len(whole)) == whole and c.complete and c.closed is None


def test_the_servers_guard_closes_an_open_reply_but_not_a_whole_one() -> None:
    c = constraint(NOTE)
    text = write(c, b'{"note": "my notes go on', limit=100)
    assert c.close("repetition guard: a cycle of 9 tokens") and not c.close("again")  # once
    text += write(c, looping(b"", b" and on"), limit=100)
    assert json.loads(text) == {"note": "my notes go on", "stars": 0} and c.closed.at_token == 24
    whole = constraint(TAGS)
    write(whole, b'{"tags": []}', limit=20)
    assert whole.complete and not whole.close("a loop after the end")


def test_markup_before_the_json_is_skipped_and_the_shape_follows_strings_and_escapes() -> None:
    shape = JsonShape()
    assert shape.feed(b'<tool_call>\n"quoted" prose {"a": "x \\" [') is None
    assert shape.in_string and shape.depth == 1
    assert shape.feed(b'", "b": [1, 2') is None and not shape.in_string and shape.depth == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text("abcdefgh -", min_size=1, max_size=6), min_size=0, max_size=4, unique=True),
       st.text("abcdefgh -", min_size=1, max_size=6))
def test_any_item_repeated_forever_closes_into_json_that_keeps_the_items_written(items: list[str], again: str) -> None:
    c = constraint(TAGS)
    head = b'{"tags": [' + b"".join(json.dumps(i).encode() + b", " for i in items)
    reply = json.loads(write(c, looping(head, json.dumps(again).encode() + b", "), limit=2000))
    jsonschema.validate(reply, TAGS)
    assert reply["tags"][:len(items)] == items and set(reply["tags"][len(items):]) == {again}
    assert c.closed is not None
