"""Which agents hold which block-aligned token prefixes (for prefix sharing).

Each complete block of an agent's token list gets a chained key, the hash of
(parent key, block tokens), like nano-vllm's prefix cache: equal keys at
block ``i`` mean (almost certainly) equal prefixes up to the end of block
``i``. Hashes only nominate candidates; the caller compares tokens before
sharing anything, so a collision can never serve the wrong cache.

Prefixes shorter than a block matter too: chat templates put the same
default system prompt (SmolLM2: 26 tokens) in front of every conversation,
and short script system prompts are shorter than 256 tokens. The first block
is therefore also keyed in chunks of ``HEAD_CHUNK`` tokens (chained the same
way), which nominate donors for a token-granular share of the first block.
"""

from __future__ import annotations

from typing import Sequence


# Granularity of the first block's keys: shorter common heads are not worth a share.
HEAD_CHUNK = 16


def chain_keys(tokens: Sequence[int], block_tokens: int, limit: int | None = None) -> list[int]:
    """One key per complete block of ``tokens`` (of the first ``limit`` tokens when given)."""
    keys: list[int] = []
    parent = 0
    stop = len(tokens) if limit is None else min(len(tokens), limit)
    for end in range(block_tokens, stop + 1, block_tokens):
        parent = hash((parent, tuple(tokens[end - block_tokens : end])))
        keys.append(parent)
    return keys


def head_keys(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """Keys of the first block's complete ``HEAD_CHUNK``-token chunks (distinct from block keys)."""
    return [hash(("head", key)) for key in chain_keys(tokens, min(HEAD_CHUNK, block_tokens), block_tokens)]


class PrefixIndex:
    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._holders: dict[int, set[str]] = {}
        self._keys: dict[str, list[int]] = {}

    def update(self, agent_id: str, tokens: Sequence[int]) -> None:
        self.remove(agent_id)
        keys = head_keys(tokens, self.block_tokens) + chain_keys(tokens, self.block_tokens)
        self._keys[agent_id] = keys
        for key in keys:
            self._holders.setdefault(key, set()).add(agent_id)

    def remove(self, agent_id: str) -> None:
        for key in self._keys.pop(agent_id, ()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(agent_id)
                if not holders:
                    del self._holders[key]

    def candidates(self, tokens: Sequence[int], exclude: str | None = None) -> list[tuple[str, int]]:
        """Agents sharing the longest block-aligned prefix with ``tokens``: (agent, blocks)."""
        best: list[tuple[str, int]] = []
        for depth, key in enumerate(chain_keys(tokens, self.block_tokens), start=1):
            holders = self._holders.get(key, set()) - {exclude}
            if not holders:
                break
            best = [(agent, depth) for agent in sorted(holders)]
        return best

    def head_candidates(self, tokens: Sequence[int], exclude: str | None = None) -> list[str]:
        """Agents whose first block starts with the longest ``HEAD_CHUNK``-aligned run of ``tokens``."""
        best: list[str] = []
        for key in head_keys(tokens, self.block_tokens):
            holders = self._holders.get(key, set()) - {exclude}
            if not holders:
                break
            best = sorted(holders)
        return best

    def __len__(self) -> int:
        return len(self._keys)
