"""The loaded model's output formats, compiled: one tokenizer table, one matcher per distinct schema.

Building llguidance's table of a tokenizer takes about a second (49K tokens
on SmolLM2; longer for Gemma's 262K), so it is built once per loaded model,
on the first constrained request, in that request's API worker thread (the
API calls :meth:`OutputGrammars.prepare` before it submits the turn), never
on the engine thread in the common case. Each distinct schema compiles once
(the cache is keyed by the schema's digest, least recently used out); every
turn then starts from a copy of the compiled matcher, which costs
microseconds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable

from engine.domain.output_format import OutputFormat
from engine.errors import InvalidRequestError
from engine.grammar.loop_closing import ClosingTokens
from engine.grammar.token_constraint import TokenConstraint

# How JSON is written: no free whitespace (a model left free to emit whitespace can emit it forever), the
# separators a person writes (``{"a": 1, "b": [2, 3]}``), as OpenAI's and Anthropic's structured outputs do.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Distinct schemas kept compiled.
CACHE_SIZE = 64


def grammar_of(fmt: OutputFormat) -> str:
    import llguidance

    if fmt.lark:
        return llguidance.LLMatcher.grammar_from_lark(fmt.lark)
    return llguidance.LLMatcher.grammar_from_json_schema(fmt.schema_json, overrides=JSON_STYLE)  # type: ignore[arg-type]


def check_format(fmt: OutputFormat, field: str) -> None:
    """Raise a 400 naming ``field`` when llguidance cannot compile ``fmt``'s schema or grammar (no tokenizer needed)."""
    import llguidance

    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar_of(fmt))
    except ValueError as error:
        problem = str(error)
    if problem:
        raise InvalidRequestError(f"{field}: {_what(fmt)} cannot be used for constrained decoding: {problem}",
                                  field=field)


def _what(fmt: OutputFormat) -> str:
    return "the tool schemas" if fmt.lark else "the JSON schema"


class OutputGrammars:
    """Compiles output formats for one tokenizer; safe to call from API worker threads and the engine thread."""

    def __init__(self, tokenizer: Any, stop_tokens: Iterable[int], cache_size: int = CACHE_SIZE,
                 close_loops: bool = True) -> None:
        self._tokenizer = tokenizer  # mlx-lm's TokenizerWrapper
        self._stop_tokens = sorted(stop_tokens)
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._table: Any = None  # llguidance.LLTokenizer, built on first use
        # Whether a loop in a constrained reply is steered closed (grammar/loop_closing.py), and the tokenizer's
        # closing classes, built with the table.
        self.close_loops = close_loops
        self._closing: ClosingTokens | None = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # format key -> compiled LLMatcher
        self.compiles = 0  # schemas compiled (not served from the cache): what the tests count

    def prepare(self, fmt: OutputFormat, field: str = "response_format") -> None:
        """Compile ``fmt`` now (a 400 naming ``field`` if it cannot be): what the API does before submitting."""
        self._template(fmt, field)

    def start(self, fmt: OutputFormat) -> TokenConstraint:
        """A fresh constraint for one turn, at the start of its reply."""
        template = self._template(fmt, "response_format")
        with self._lock:
            matcher = template.deep_copy()
            closing = self._closing if self.close_loops else None
        return TokenConstraint(matcher, self._stop_tokens, closing)

    def _template(self, fmt: OutputFormat, field: str) -> Any:
        import llguidance

        with self._lock:
            compiled = self._compiled.get(fmt.key)
            if compiled is not None:
                self._compiled.move_to_end(fmt.key)
                return compiled
            table = self._table_locked()
        check_format(fmt, field)
        # (drops the GIL while it compiles; silent: a refused token is logged by TokenConstraint, once)
        matcher = llguidance.LLMatcher(table, grammar_of(fmt), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{field}: {_what(fmt)} cannot be used for constrained decoding: "
                                      f"{matcher.get_error()}", field=field)
        with self._lock:
            self.compiles += 1
            self._compiled[fmt.key] = matcher
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return matcher

    def _table_locked(self) -> Any:
        if self._table is None:
            import llguidance.hf

            inner = getattr(self._tokenizer, "_tokenizer", self._tokenizer)  # the Hugging Face tokenizer
            eos = self._stop_tokens or None
            try:
                if hasattr(inner, "backend_tokenizer"):
                    self._table = llguidance.hf.from_tokenizer(inner, eos_token=eos)
                else:  # a tokenizer that lists its tokens as bytes (llguidance's TokenizerWrapper protocol)
                    self._table = llguidance.LLTokenizer(llguidance.TokenizerWrapper(inner), eos_token=eos)
            except (ValueError, TypeError, AttributeError) as error:
                raise InvalidRequestError(
                    f"structured outputs need the model's tokenizer.json (a fast tokenizer); this model's "
                    f"tokenizer cannot be read for constrained decoding: {error}", field="response_format") from error
            self._closing = ClosingTokens.of(self._table)  # ~0.1 s for SmolLM2's 49K tokens
        return self._table
