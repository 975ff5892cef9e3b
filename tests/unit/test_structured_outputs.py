"""Structured outputs: each protocol's field read into an OutputFormat, schemas compiled once, and constrained
rows decoded in the same batch as free ones (tiny random-weight models, byte tokenizer).

The engine tests compare with plain mlx-lm: ``generate_step`` with a logits processor that applies the same
schema's mask from a matcher of its own. A constrained row in a mixed, pipelined (and speculating) batch must
produce exactly those tokens, and the free rows beside it exactly plain greedy decoding's.
"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step, generation_stream

from engine.api.output_formats import anthropic_output_format, openai_response_format, responses_text_format
from engine.domain.output_format import OutputFormat
from engine.domain.requests import FinishReason, GenerationRequest, SamplingParams
from engine.errors import InvalidRequestError
from engine.grammar.output_grammars import OutputGrammars
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from engine.runtime.runner.token_masks import Allow, allowed_rows, masked
from tests.support.byte_tokenizer import BOS, EOS, ByteTokenizer
from tests.support.engine_settings import engine_settings
from tests.support.json_schemas import SCHEMAS
from tests.support.reference import PREFILL_STEP, reference_greedy
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


# -- protocol fields ---------------------------------------------------------------------------------
def test_each_protocols_field_reads_into_one_format() -> None:
    schema_format = OutputFormat.from_schema(PERSON, "person")
    assert openai_response_format({"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": PERSON, "strict": True}}) == schema_format
    assert responses_text_format({"format": {"type": "json_schema", "name": "person", "schema": PERSON}}) == schema_format
    assert anthropic_output_format({"format": {"type": "json_schema", "schema": PERSON}}, None).schema == PERSON
    assert anthropic_output_format(None, {"type": "json_schema", "schema": PERSON}).schema == PERSON
    assert openai_response_format({"type": "json_object"}) == OutputFormat.any_object()
    assert responses_text_format({"format": {"type": "json_object"}}) == OutputFormat.any_object()
    for free in (openai_response_format(None), openai_response_format({"type": "text"}),
                 responses_text_format(None), responses_text_format({"format": {"type": "text"}}),
                 responses_text_format({"verbosity": "low"}), anthropic_output_format({"effort": "low"}, None)):
        assert free is None


@pytest.mark.parametrize("read, value, field", [
    (openai_response_format, {"type": "xml"}, "response_format.type"),
    (openai_response_format, {"type": "json_schema"}, "response_format.json_schema"),
    (openai_response_format, {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "response_format.json_schema.schema"),
    (openai_response_format, "json", "response_format"),
    (responses_text_format, {"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
    (lambda value: anthropic_output_format({"format": value}, None), {"type": "json_object"}, "output_config.format.type"),
])
def test_a_bad_shape_is_a_400_naming_the_field(read, value, field: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        read(value)
    assert raised.value.field == field


def test_the_format_keeps_the_schemas_key_order_and_names_it_by_digest() -> None:
    a = OutputFormat.from_schema({"type": "object", "properties": {"a": {}, "b": {}}})
    b = OutputFormat.from_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    assert a.key != b.key  # properties are written in the schema's order: not the same format
    assert a.key == OutputFormat.from_schema(json.loads(a.schema_json)).key


# -- compiling ---------------------------------------------------------------------------------------
def test_a_schema_compiles_once_and_each_turn_starts_from_a_copy() -> None:
    grammars = OutputGrammars(ByteTokenizer(), [EOS])
    fmt = OutputFormat.from_schema(PERSON)
    grammars.prepare(fmt)
    first, second = grammars.start(fmt), grammars.start(OutputFormat.from_schema(PERSON))
    assert grammars.compiles == 1
    for token in b'{"name": "':
        first.consume(token)
    assert _allowed_bytes(second) == {ord("{")}  # the copy started fresh: the first turn's tokens are its own


def test_a_schema_the_library_cannot_compile_is_a_400_naming_the_field() -> None:
    grammars = OutputGrammars(ByteTokenizer(), [EOS])
    with pytest.raises(InvalidRequestError, match="strin") as raised:
        grammars.prepare(OutputFormat.from_schema({"type": "object", "properties": {"a": {"type": "strin"}}}),
                         "text.format")
    assert raised.value.field == "text.format"


def test_the_mask_allows_only_what_the_schema_allows_and_the_end_only_when_complete() -> None:
    grammars = OutputGrammars(ByteTokenizer(), [EOS])
    constraint = grammars.start(OutputFormat.from_schema(PERSON))
    text = b'{"name": "Ann", "age": 4'
    for token in text:
        assert token in _allowed_bytes(constraint), bytes([token])
        constraint.consume(token)
    assert _allowed_bytes(constraint) >= {ord("2"), ord(",")} and ord("}") not in _allowed_bytes(constraint)
    for token in b', "pet": "dog"}':
        constraint.consume(token)
    assert constraint.complete and constraint.accepting
    assert _allowed(constraint) == {EOS}


def _allowed(constraint) -> set[int]:
    bits = np.unpackbits(constraint.allowed().view(np.uint8), bitorder="little")
    return set(np.nonzero(bits)[0].tolist())


def _allowed_bytes(constraint) -> set[int]:
    return {t for t in _allowed(constraint) if t < 256}


def test_masks_cover_only_their_rows_and_never_allow_tokens_past_the_tokenizers() -> None:
    words = np.zeros(2, dtype=np.uint32)
    words[0] = 1 << 3  # token 3 only
    allow = allowed_rows(70, 3, [(1, Allow(words))])
    assert allow[0].all() and allow[2].all()
    assert np.nonzero(allow[1])[0].tolist() == [3]  # tokens 64-69 lie past the 64-bit mask: never allowed
    logits = mx.zeros((3, 70))
    out = np.array(masked(logits, [(1, Allow(words))]))
    assert np.isinf(out[1]).sum() == 69 and np.isfinite(out[0]).all()


# -- the engine ----------------------------------------------------------------------------------------
def make_engine(kind: str, speculate: str = "lookup", batch: int = 8) -> Engine:
    engine = Engine(loaded_tiny(kind, block_tokens=16),
                    engine_settings(64 * 2**20, batch, 32, speculate=speculate, speculate_max_draft=8))
    engine.start()
    return engine


def prompt(i: int) -> tuple[int, ...]:
    """Prompts that repeat themselves: the free rows beside a constrained one get drafts (speculative steps)."""
    return (BOS, *(f"{i} abc abc abc abc abc abc ".encode()))


def reference_constrained(model, tokens: tuple[int, ...], fmt: OutputFormat, max_tokens: int) -> list[int]:
    """Plain mlx-lm greedy decoding with the schema's mask applied by a logits processor of its own."""
    constraint = OutputGrammars(ByteTokenizer(), [EOS]).start(fmt)
    consumed = 0  # generated tokens fed to the constraint (generate_step asks for the next mask before it yields)

    def catch_up(generated: list[int]) -> None:
        nonlocal consumed
        for token in generated[consumed:]:
            constraint.consume(token)
        consumed = max(consumed, len(generated))

    def mask(history: mx.array, logits: mx.array) -> mx.array:
        catch_up(history.tolist()[len(tokens):])
        return masked(logits, [(0, Allow(constraint.allowed()))])

    out: list[int] = []
    steps = generate_step(mx.array(tokens), model, max_tokens=max_tokens, prefill_step_size=PREFILL_STEP,
                          logits_processors=[mask])
    for (token, _), _ in zip(steps, range(max_tokens)):
        out.append(int(token))
        catch_up(out)
        if int(token) == EOS or constraint.complete:
            break
    steps.close()
    mx.synchronize(generation_stream)
    return out


@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("speculate", ["lookup", "off"])
def test_constrained_and_free_rows_in_one_batch_each_decode_as_alone(kind: str, speculate: str) -> None:
    engine = make_engine(kind, speculate)
    try:
        fmt = OutputFormat.from_schema(PERSON)
        engine.grammars.prepare(fmt)
        requests = [GenerationRequest(f"a{i}", prompt(i), 60, output_format=fmt if i % 2 else None)
                    for i in range(6)]
        results = run_turns(engine, requests)
        model = engine.loaded.model
        for request, result in zip(requests, results):
            if request.output_format is None:
                expected = reference_greedy(model, list(request.prompt_tokens), 60, {EOS})
                assert result.tokens == [t for t in expected if t != EOS]
                continue
            assert result.tokens == reference_constrained(model, request.prompt_tokens, fmt, 60)
            assert result.finish.reason is FinishReason.COMPLETE
            jsonschema.validate(json.loads(bytes(result.tokens).decode()), PERSON)
            assert result.finish.usage.speculation is None  # a constrained row never drafts
        free_tallies = [r.finish.usage.speculation for q, r in zip(requests, results) if q.output_format is None]
        if speculate == "lookup" and kind == "llama":  # (the tiny Gemma's free rows here find no drafts)
            assert sum(t.accepted for t in free_tallies if t is not None) > 0, "the free rows should have drafted"
    finally:
        engine.stop(0.0)


def test_sampled_constrained_turns_validate_over_all_ten_schemas() -> None:
    engine = make_engine("llama")
    try:
        requests = []
        for i, (_, _, schema) in enumerate(SCHEMAS):
            fmt = OutputFormat.from_schema(schema)
            engine.grammars.prepare(fmt)
            requests.append(GenerationRequest(f"s{i}", prompt(i), 400, output_format=fmt,
                                              sampling=SamplingParams(temperature=0.8, seed=i)))
        results = run_turns(engine, requests)
        for (_, _, schema), result in zip(SCHEMAS, results):
            text = bytes(t for t in result.tokens if t < 256).decode("utf-8", errors="replace")
            if result.finish.reason is FinishReason.COMPLETE:
                jsonschema.validate(json.loads(text), schema)
            else:  # a random model may write long strings: then it says so, never "stop"
                assert result.finish.reason.outcome == "length", result.finish.reason
        assert sum(r.finish.reason is FinishReason.COMPLETE for r in results) >= 5
    finally:
        engine.stop(0.0)


def test_a_reply_cut_before_its_json_closes_reports_truncation_never_stop() -> None:
    engine = make_engine("llama")
    try:
        fmt = OutputFormat.from_schema(PERSON)
        engine.grammars.prepare(fmt)
        short = run_turn(engine, GenerationRequest("t1", prompt(1), 5, output_format=fmt))
        assert short.finish.reason is FinishReason.LENGTH and bytes(short.tokens) == b'{"nam'
        # A stop string inside the JSON would cut it: reported as truncation, with a note saying why.
        cut = run_turn(engine, GenerationRequest("t2", prompt(1), 60, output_format=fmt, stop_strings=('"age',)))
        assert cut.finish.reason is FinishReason.FORMAT_CUT and cut.finish.reason.outcome == "length"
        assert "JSON was cut short" in (cut.finish.note or "")
    finally:
        engine.stop(0.0)


# -- bad input never becomes a 500 -------------------------------------------------------------------
_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, width=16)
                     | st.sampled_from(["object", "string", "integer", "array", "number", "x", ""]),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "required",
                                                         "minimum", "maxLength", "anyOf", "$ref", "a"]),
                                       inner, max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(schema=st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "required", "anyOf",
                                               "additionalProperties", "$defs", "$ref"]), _json, max_size=4))
def test_any_schema_compiles_or_is_a_400_never_another_error(schema: dict) -> None:
    grammars = _FUZZ_GRAMMARS
    fmt = openai_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    try:
        grammars.prepare(fmt)
    except InvalidRequestError as error:
        assert error.field == "response_format"
        return
    constraint = grammars.start(fmt)
    assert constraint.allowed().any()  # a compiled schema allows some first token (or the end)


@settings(max_examples=150, deadline=None)
@given(value=_json)
def test_any_response_format_value_reads_or_is_a_400(value) -> None:
    for read in (openai_response_format, lambda v: responses_text_format({"format": v}),
                 lambda v: anthropic_output_format({"format": v}, None)):
        try:
            read(value)
        except InvalidRequestError as error:
            assert error.field


_FUZZ_GRAMMARS = OutputGrammars(ByteTokenizer(), [EOS])


def test_an_end_forced_at_a_dead_end_is_reported_as_truncation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a matcher ever allow nothing (it fails over to the end-of-sequence token), the unfinished JSON is
    reported as truncation, with a note, not as a finished reply."""
    from engine.grammar.token_constraint import TokenConstraint

    real = TokenConstraint.allowed
    consumed: dict[int, int] = {}
    real_consume = TokenConstraint.consume

    def consume(self, token: int) -> None:
        consumed[id(self)] = consumed.get(id(self), 0) + 1
        real_consume(self, token)

    def allowed(self):
        words = real(self)
        if consumed.get(id(self), 0) >= 3:  # a dead end after three tokens: only the end remains
            words[:] = 0
            words[EOS // 32] |= np.uint32(1 << (EOS % 32))
        return words

    monkeypatch.setattr(TokenConstraint, "consume", consume)
    monkeypatch.setattr(TokenConstraint, "allowed", allowed)
    engine = make_engine("llama", "off")
    try:
        fmt = OutputFormat.from_schema(PERSON)
        engine.grammars.prepare(fmt)
        result = run_turn(engine, GenerationRequest("dead", prompt(1), 60, output_format=fmt))
        assert bytes(t for t in result.tokens if t < 256) == b'{"n'
        assert result.finish.reason is FinishReason.FORMAT_CUT
        assert "allowed no further token" in (result.finish.note or "")
    finally:
        engine.stop(0.0)
