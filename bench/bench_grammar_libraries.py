"""llguidance against outlines-core for JSON-schema constrained decoding, on this machine's CPU.

The engine constrains structured outputs with llguidance (engine/grammar).
This measures why, against the other library that runs without torch,
outlines-core, per tokenizer (SmolLM2's 49K byte-level BPE, Gemma 3's 262K
sentencepiece-style vocabulary) and per library:

- table build: llguidance's token table (``llguidance.hf.from_tokenizer``),
  outlines-core's ``Vocabulary`` (each token's bytes, converted here in
  Python from the Hugging Face vocabulary: that conversion is counted);
- compile, per schema of ``tests/support/json_schemas.py``: llguidance's
  matcher built exactly as the engine builds it (``check_format`` then
  ``LLMatcher(table, grammar_of(fmt))``, with the engine's ``JSON_STYLE``);
  outlines-core's regex (``build_regex_from_schema``) and its ``Index``.
  The two split the work differently: outlines-core builds the index of
  every state against the whole vocabulary up front, so a mask is a lookup
  and a copy; llguidance compiles little and does its work per mask (it
  walks the vocabulary's token trie against the grammar at each step,
  building lexer states lazily);
- mask: walking one hand-written valid instance of each schema, serialized
  the way ``JSON_STYLE`` writes JSON (``{"a": 1, "b": [2, 3]}``), token by
  token: the time to compute each token's mask (llguidance's
  ``compute_bitmask``, what the engine calls; outlines-core's
  ``write_mask_into`` a preallocated int32 array), plus the time to advance
  past the token, and whether every token of the instance, then the end of
  sequence, was allowed. The first walk of each schema is cold (llguidance
  fills its lexer cache then); the later ones start from a copy of the
  compiled matcher (llguidance, as each engine turn does) or a fresh
  ``Guide`` on the same index (outlines-core);
- whether each rejects a broken schema (a misspelt type), and with what message.

outlines-core is given the whitespace pattern ``[ ]?`` (at most one space
wherever JSON allows whitespace): the closest it comes to ``JSON_STYLE``,
which allows exactly one space after ``,`` and ``:`` and none elsewhere. An
outlines-core index that takes over 60 s to build stops outlines-core for that
tokenizer once it is built (the native call cannot be interrupted): the table's
last column then says "index over 60 s on <schema>: stopped".

xgrammar is not compared: its Python package requires torch, transformers and
triton, which this project does not install.

Run: ``.venv/bin/python -m bench.bench_grammar_libraries [--model-dir FOLDER ...] [--json PATH]``
(``--quick``: three schemas, two walks each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

import jsonschema
import numpy as np

from bench.bench_vs_mlx_lm_server import model_folder
from bench.common import print_table  # (common puts the repository root on sys.path)
from bench.results import BenchResult, recorded

from engine.domain.output_format import OutputFormat
from engine.errors import InvalidRequestError
from engine.grammar.output_grammars import JSON_STYLE, check_format, grammar_of
from tests.support.json_schemas import SCHEMAS

DEFAULT_MODELS = (
    "smollm2-135m",  # 49K tokens, byte-level BPE
    "gemma3-270m",  # 262K tokens, sentencepiece-style
)
OUTLINES_WHITESPACE = r"[ ]?"
OUTLINES_INDEX_LIMIT_S = 60.0
BROKEN_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}

# One valid instance per schema of SCHEMAS, keys in the schema's property order (outlines-core's regex
# writes properties in that order). "Zoë" puts a multi-byte character through both token tables.
INSTANCES: dict[str, dict[str, Any]] = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "weather": {"city": "Paris", "celsius": 18.5, "sky": "cloudy"},
    "todo": {"items": ["passport", "toothbrush", "charger"]},
    "address": {"street": "12 Rue de Rivoli", "city": "Paris", "geo": {"lat": 48.8566, "lon": 2.3522}},
    "review": {"title": "Spirited Away", "stars": 5, "recommend": True},
    "tool_call": {"command": "ls", "args": ["-la", "/tmp"]},
    "color": {"name": "orange", "rgb": [255, 165, 0]},
    "order": {"size": "large", "quantity": 2, "customer": {"name": "Zoë"}},
    "event": {"topic": "Quarterly planning", "minutes": 45, "remote": False, "attendees": ["Ana", "Bo"]},
    "math": {"answer": 42, "confidence": 0.95},
}


def serialized(instance: dict[str, Any]) -> str:
    """The instance as llguidance's ``JSON_STYLE`` writes it (raw UTF-8, no ``\\u`` escapes)."""
    return json.dumps(instance, separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]),
                      ensure_ascii=False)


# --- tokenizers -------------------------------------------------------------------------------------------


@dataclass
class Tokenizer:
    name: str
    hf: Any  # the Hugging Face fast tokenizer
    eos_ids: list[int]  # what the engine passes llguidance as stop tokens (LoadedModel.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def special_ids(self) -> set[int]:
        added = {i for i, token in self.hf.added_tokens_decoder.items() if token.special}
        return added | set(self.hf.all_special_ids) | set(self.eos_ids)


def load_tokenizer(folder: Path) -> Tokenizer:
    from mlx_lm.tokenizer_utils import load

    wrapper = load(folder)
    return Tokenizer(folder.name, wrapper._tokenizer, sorted(wrapper.eos_token_ids))


def _gpt2_byte_of_char() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: byte-level BPE writes byte ``b`` as a printable character
    (itself when printable, else ``chr(256 + n)`` for the n-th unprintable byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _gpt2_byte_of_char()


def _byte_level_bytes(text: str) -> bytes:
    return bytes(_BYTE_OF_CHAR[c] for c in text)


def _sentencepiece_bytes(text: str) -> bytes:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):  # a byte-fallback token
        return bytes([int(text[3:5], 16)])
    return text.replace("▁", " ").encode()


def _decoder_types(hf: Any) -> set[str]:
    """The types of the tokenizer's decoder steps (a Sequence is opened)."""
    decoder = json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {step.get("type", "") for step in steps}


def token_bytes(tok: Tokenizer) -> tuple[dict[int, bytes], str]:
    """Every non-special token's bytes, for outlines-core (which needs bytes, not the vocabulary's strings),
    and which conversion was used. Added (non-special) tokens are stored as their plain text."""
    types = _decoder_types(tok.hf)
    added = {i: t.content for i, t in tok.hf.added_tokens_decoder.items() if not t.special}
    special = tok.special_ids
    convert: Callable[[str], bytes]
    if "ByteLevel" in types:
        convert, kind = _byte_level_bytes, "byte-level BPE (GPT-2 byte map)"
    elif types & {"ByteFallback", "Metaspace", "Replace"}:
        convert, kind = _sentencepiece_bytes, "sentencepiece (▁ as space, <0xXX> as a byte)"
    else:
        raise ValueError(f"{tok.name}: no byte conversion for a decoder of types {sorted(types)}")
    out = {}
    for text, i in tok.hf.get_vocab().items():
        if i not in special:
            out[i] = added[i].encode() if i in added else convert(text)
    return out, kind


def conversion_mismatches(converted: dict[int, bytes], table: Any) -> list[tuple[int, bytes, bytes]]:
    """Tokens whose bytes (as converted for outlines-core) differ from llguidance's own reading of them."""
    return [(i, b, ref) for i, b in converted.items() if (ref := table.decode_bytes([i])) != b]


# --- the two libraries ------------------------------------------------------------------------------------


class Cursor(Protocol):
    """One walk through a schema: ``mask()`` the allowed tokens as little-endian bits, ``advance(t)`` past ``t``."""

    def mask(self) -> Any: ...

    def advance(self, token: int) -> bool: ...

    def finished(self) -> bool: ...


class Llguidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        import llguidance.hf

        self.table = llguidance.hf.from_tokenizer(tok.hf, eos_token=tok.eos_ids)

    def compile(self, schema: dict[str, Any]) -> Any:
        """What ``OutputGrammars._template`` does for a schema it has not seen."""
        import llguidance

        fmt = OutputFormat.from_schema(schema)
        check_format(fmt, "schema")
        matcher = llguidance.LLMatcher(self.table, grammar_of(fmt))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    @staticmethod
    def start(compiled: Any) -> Cursor:
        return _LlgCursor(compiled.deep_copy())  # what each engine turn starts from

    @staticmethod
    def rejects(schema: dict[str, Any]) -> str | None:
        try:
            check_format(OutputFormat.from_schema(schema), "schema")
        except InvalidRequestError as error:
            return str(error)
        return None


class _LlgCursor:
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def mask(self) -> bytes:
        # What TokenConstraint.allowed calls: a fresh bytes object per call (``unsafe_compute_mask_ptr``
        # would write into a preallocated buffer, as outlines-core's cursor below does).
        return self.matcher.compute_bitmask()

    def advance(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def finished(self) -> bool:
        return self.matcher.is_accepting()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok: Tokenizer) -> None:
        import outlines_core

        self.token_bytes, self.conversion = token_bytes(tok)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in self.token_bytes.items():
            by_bytes.setdefault(b, []).append(i)  # several ids can spell the same bytes
        self.vocabulary = outlines_core.Vocabulary(tok.eos_ids[0], by_bytes)  # (one eos only)
        self.words = (tok.vocab_size + 31) // 32

    def compile(self, schema: dict[str, Any]) -> Any:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern=OUTLINES_WHITESPACE)
        return outlines_core.Index(regex, self.vocabulary)

    def start(self, compiled: Any) -> Cursor:
        import outlines_core

        return _OutlinesCursor(outlines_core.Guide(compiled), self.words)

    @staticmethod
    def rejects(schema: dict[str, Any]) -> str | None:
        from outlines_core.json_schema import build_regex_from_schema

        try:
            build_regex_from_schema(json.dumps(schema), whitespace_pattern=OUTLINES_WHITESPACE)
        except ValueError as error:
            return str(error)
        return None


class _OutlinesCursor:
    def __init__(self, guide: Any, words: int) -> None:
        self.guide = guide
        self.buffer = np.zeros(words, dtype=np.int32)
        self.ptr = self.buffer.ctypes.data
        self.view = memoryview(self.buffer).cast("B")  # the same memory, read as bytes

    def mask(self) -> memoryview:
        self.guide.write_mask_into(self.ptr, self.buffer.size, 4)
        return self.view

    def advance(self, token: int) -> bool:
        try:
            self.guide.advance(token, return_tokens=False)
        except ValueError:  # "No next state found for the current state"
            return False
        return True

    def finished(self) -> bool:
        return self.guide.is_finished()


# --- measuring --------------------------------------------------------------------------------------------


def allows(mask: Any, token: int) -> bool:
    """Token ``t`` is bit ``t % 32`` of little-endian 32-bit word ``t // 32``: bit ``t % 8`` of byte ``t // 8``."""
    return bool(mask[token >> 3] >> (token & 7) & 1)


@dataclass
class Walk:
    mask_us: list[float] = field(default_factory=list)
    advance_us: list[float] = field(default_factory=list)
    problem: str | None = None  # the first token (or the end) refused


def walk(cursor: Cursor, tokens: list[int], eos: int) -> Walk:
    """Mask, check, advance for every token, then check that the end of sequence is allowed."""
    out = Walk()
    for n, token in enumerate(tokens):
        t0 = time.perf_counter_ns()
        mask = cursor.mask()
        t1 = time.perf_counter_ns()
        allowed = allows(mask, token)
        t2 = time.perf_counter_ns()
        advanced = cursor.advance(token)
        t3 = time.perf_counter_ns()
        out.mask_us.append((t1 - t0) / 1000)
        out.advance_us.append((t3 - t2) / 1000)
        if not (allowed and advanced):
            out.problem = f"token {n} ({token}) {'masked out' if not allowed else 'refused on advance'}"
            return out
    t0 = time.perf_counter_ns()
    mask = cursor.mask()  # the step that samples the end of sequence
    out.mask_us.append((time.perf_counter_ns() - t0) / 1000)
    if not (cursor.finished() and allows(mask, eos)):
        out.problem = "the end of sequence is not allowed after the last token"
    return out


@dataclass
class Row:
    library: str
    table_s: float = float("nan")
    compile_ms: dict[str, float] = field(default_factory=dict)  # schema key -> ms
    first_walk_us: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)
    advance_us: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    stopped: str | None = None  # why outlines-core stopped early on this tokenizer

    def cells(self) -> list[object]:
        compiled = list(self.compile_ms.values())
        mask = np.array(self.mask_us or [float("nan")])
        accepted = "no" if self.problems else ("yes" if self.mask_us else "-")
        return [self.library, self.table_s, statistics.median(compiled) if compiled else float("nan"),
                max(compiled, default=float("nan")), float(mask.mean()), float(np.percentile(mask, 99)),
                float(mask.max()), _mean(self.first_walk_us), _mean(self.advance_us),
                accepted + (f" ({self.stopped})" if self.stopped else "")]


HEADERS = ["library", "table build s", "compile ms median", "compile ms max", "mask µs mean", "mask µs p99",
           "mask µs max", "1st walk mask µs mean", "advance µs mean", "all accepted"]
METRICS = [  # (table column, metric name in the JSON, unit)
    ("table build s", "table build", "s"), ("compile ms median", "compile median", "ms"),
    ("compile ms max", "compile max", "ms"), ("mask µs mean", "mask mean", "µs"), ("mask µs p99", "mask p99", "µs"),
    ("mask µs max", "mask max", "µs"), ("1st walk mask µs mean", "first walk mask mean", "µs"),
    ("advance µs mean", "advance mean", "µs"),
]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def bench_tokenizer(folder: Path, schemas: list[tuple[str, dict[str, Any]]], repeats: int,
                    result: BenchResult) -> None:
    tok = load_tokenizer(folder)
    print(f"\n## {tok.name}: {tok.vocab_size} tokens, eos {tok.eos_ids}")
    libraries: dict[str, Any] = {}
    rows: dict[str, Row] = {}
    for cls in (Llguidance, OutlinesCore):
        t0 = time.perf_counter()
        libraries[cls.name] = cls(tok)
        rows[cls.name] = Row(cls.name, table_s=time.perf_counter() - t0)
        print(f"# {cls.name}: table built in {rows[cls.name].table_s:.2f} s", flush=True)
    check_conversion(tok, libraries["outlines-core"], libraries["llguidance"].table, result)

    for key, schema in schemas:
        tokens = tok.hf.encode(serialized(INSTANCES[key]), add_special_tokens=False)
        for name, library in libraries.items():
            row = rows[name]
            if row.stopped:
                continue
            t0 = time.perf_counter()
            compiled = library.compile(schema)
            seconds = time.perf_counter() - t0
            row.compile_ms[key] = seconds * 1000
            if name == "outlines-core" and seconds > OUTLINES_INDEX_LIMIT_S:
                row.stopped = f"index over {OUTLINES_INDEX_LIMIT_S:.0f} s on {key}: stopped"
            for n in range(repeats):
                one = walk(library.start(compiled), tokens, tok.eos_ids[0])
                row.mask_us.extend(one.mask_us)
                row.advance_us.extend(one.advance_us)
                if n == 0:
                    row.first_walk_us.extend(one.mask_us)
                if one.problem:
                    row.problems.append(f"{key}: {one.problem}")
                    break
        print(f"# {key}: {len(tokens)} tokens; compile " + ", ".join(
            f"{name} {rows[name].compile_ms[key]:.1f} ms" for name in libraries if key in rows[name].compile_ms),
            flush=True)

    print_table(HEADERS, [rows[name].cells() for name in libraries])
    record(tok, list(rows.values()), result)


def check_conversion(tok: Tokenizer, outlines: OutlinesCore, table: Any, result: BenchResult) -> None:
    """Compare the bytes given outlines-core with llguidance's (which reads the tokenizer itself)."""
    bad = conversion_mismatches(outlines.token_bytes, table)
    line = (f"{tok.name}: outlines-core vocabulary from {outlines.conversion}, {len(outlines.token_bytes)} tokens "
            f"(special tokens and eos left out); {len(bad)} differ from llguidance's bytes")
    if bad:
        line += ", e.g. " + ", ".join(f"{i}: {b!r} vs {ref!r}" for i, b, ref in bad[:5])
    print(f"# {line}")
    result.notes.append(line + ".")


def record(tok: Tokenizer, rows: list[Row], result: BenchResult) -> None:
    for row in rows:
        group = f"{tok.name} ({tok.vocab_size} tokens): {row.library}"
        cells = dict(zip(HEADERS, row.cells()))
        for header, name, unit in METRICS:
            result.metric(group, name, cells[header], unit, "lower")
        for key, ms in row.compile_ms.items():
            result.metric(group, f"compile {key}", ms, "ms", "lower")
        result.metric(group, "all tokens accepted", 0.0 if row.problems else 1.0, "bool", "higher")
        for problem in row.problems:
            result.notes.append(f"{tok.name}, {row.library}: refused {problem}.")
        if row.stopped:
            result.notes.append(f"{tok.name}, {row.library}: {row.stopped} (schemas after it not measured).")


def broken_schema(result: BenchResult) -> None:
    print(f"\n## broken schema {json.dumps(BROKEN_SCHEMA)}")
    rows = []
    for cls in (Llguidance, OutlinesCore):
        message = cls.rejects(BROKEN_SCHEMA)
        rows.append([cls.name, "yes" if message else "no", message or "-"])
        result.notes.append(f"Broken schema {json.dumps(BROKEN_SCHEMA)}: {cls.name} "
                            + (f"rejects it: {message}" if message else "accepts it"))
    print_table(["library", "rejected", "message"], rows)


def checked_instances(keys: list[str]) -> None:
    """Every schema has a hand-written instance, and it validates."""
    schemas = {key: schema for key, _, schema in SCHEMAS}
    missing = set(schemas) - set(INSTANCES)
    if missing:
        raise SystemExit(f"no instance written for schemas {sorted(missing)}")
    for key in keys:
        jsonschema.validate(INSTANCES[key], schemas[key])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, action="append", metavar="FOLDER",
                        help="a model folder with tokenizer.json (repeatable; default: the packaged SmolLM2 and "
                             "Gemma 3 270M, imported into the server's cache directory on first use)")
    parser.add_argument("--repeats", type=int, default=5, help="walks of each schema's instance (default 5)")
    parser.add_argument("--quick", action="store_true", help="three schemas, two walks each: a smoke run")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write the results as JSON (bench/results.py) for bench/report.py")
    args = parser.parse_args()
    folders = args.model_dir or [model_folder(ref) for ref in DEFAULT_MODELS]
    chosen = SCHEMAS[:3] if args.quick else SCHEMAS
    repeats = 2 if args.quick else args.repeats
    checked_instances([key for key, _, _ in chosen])

    result = BenchResult("bench_grammar_libraries", "Constrained decoding: llguidance vs outlines-core",
                         {"model_dirs": [str(f) for f in folders], "schemas": [k for k, _, _ in chosen],
                          "repeats": repeats, "outlines_whitespace": OUTLINES_WHITESPACE,
                          "llguidance": version("llguidance"), "outlines_core": version("outlines_core")})
    result.notes.append(f"Instances serialized as JSON_STYLE writes them ({JSON_STYLE}); outlines-core given the "
                        f"whitespace pattern {OUTLINES_WHITESPACE!r}, which accepts the same text.")
    print(f"# llguidance {version('llguidance')}, outlines-core {version('outlines_core')}; "
          f"{len(chosen)} schemas, {repeats} walks each")
    with recorded(result, args.json):
        broken_schema(result)
        for folder in folders:
            bench_tokenizer(folder, [(key, schema) for key, _, schema in chosen], repeats, result)


if __name__ == "__main__":
    main()
