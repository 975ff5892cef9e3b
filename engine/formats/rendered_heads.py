"""Rendered heads (system prompt and tools) of recent conversations: every turn of a session has the same."""

from __future__ import annotations

from collections import OrderedDict

# Distinct heads kept: one per tool or session in use at once is plenty.
HEADS_KEPT = 32


class RenderedHeads:
    """A small LRU map of a head's hash to its tokens, for one loaded model's tokenizer."""

    def __init__(self, kept: int = HEADS_KEPT) -> None:
        self._kept = kept
        self._heads: OrderedDict[str, list[int]] = OrderedDict()

    def get(self, key: str) -> list[int] | None:
        tokens = self._heads.get(key)
        if tokens is not None:
            self._heads.move_to_end(key)
        return tokens

    def put(self, key: str, tokens: list[int]) -> list[int]:
        self._heads[key] = tokens
        while len(self._heads) > self._kept:
            self._heads.popitem(last=False)
        return tokens
