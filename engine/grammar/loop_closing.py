"""Steering a constrained reply closed once it loops: of the tokens its grammar allows, those that end it soonest.

When a loop is noticed in a reply under a JSON schema (token_constraint.py), the rest of the reply is
steered, not cut: at every step the grammar's own mask is narrowed to the first of these classes that
it allows, so the JSON parses and validates, and the model still chooses within the class:

- inside a string: a quote that closes it, perhaps with brackets after it (``"``, ``"]``, ``"]}``);
- elsewhere: brackets that close what is open (``]``, ``}}``); else a separator (``,``: a number ends, the next
  required property comes); else the shortest values (``""``, ``[]``, ``{}``, ``0``, ``false``, ``null``: where
  a required property or ``minItems`` still wants one);
- else whatever the grammar allows (an enum's letters, a property's forced name).

The grammar decides what is valid, so a class never lets an invalid token in; the classes only rank
valid ones. A schema whose remaining requirements cannot be met soon (a long ``minLength``) is written
out by the model under the grammar alone, and a reply that cannot close before ``max_tokens`` ends
``length``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

_STRING_CLOSE = re.compile(rb'"[\]}]*')
_CLOSE = re.compile(rb"[\]}]+")
_EMPTY = re.compile(rb'(""|\[\]|\{\}|0|false|null)[\]}]*')
_SEPARATE = re.compile(rb",.*", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ClosingTokens:
    """One tokenizer's tokens by the part they can play in closing a reply: bitmasks in the grammar's layout
    (token ``t`` at bit ``t % 32`` of 32-bit word ``t // 32``), and every token's bytes (what the reply's JSON
    shape reads)."""

    token_bytes: tuple[bytes, ...]
    string_close: np.ndarray
    close: np.ndarray
    empty: np.ndarray
    separate: np.ndarray

    @classmethod
    def of(cls, table: Any) -> "ClosingTokens":
        """From an llguidance tokenizer table (``LLTokenizer``): each token's bytes, special tokens as none."""
        size = table.vocab_size
        special = getattr(table, "is_special_token", lambda t: False)
        token_bytes = tuple(b"" if special(t) else bytes(table.decode_bytes([t])) for t in range(size))
        return cls(token_bytes, *(_words(token_bytes, pattern) for pattern in (_STRING_CLOSE, _CLOSE, _EMPTY,
                                                                                 _SEPARATE)))

    def prefer(self, allowed: np.ndarray, in_string: bool) -> np.ndarray:
        """``allowed`` (a grammar's bitmask) narrowed to the first class it shares tokens with."""
        # A separator before the shortest values: where both are allowed, the value is a number being written, and
        # its next digit ("0") would only lengthen it.
        for tier in (self.string_close,) if in_string else (self.close, self.separate, self.empty):
            chosen = np.zeros_like(allowed)  # (the grammar's mask may run a word past the table's tokens)
            n = min(len(allowed), len(tier))
            chosen[:n] = allowed[:n] & tier[:n]
            if chosen.any():
                return chosen
        return allowed


def _words(token_bytes: tuple[bytes, ...], pattern: re.Pattern[bytes]) -> np.ndarray:
    bits = np.zeros(-(-len(token_bytes) // 32) * 32, dtype=np.uint8)
    for token, data in enumerate(token_bytes):
        if data and pattern.fullmatch(data):
            bits[token] = 1
    return np.packbits(bits, bitorder="little").view(np.uint32)
