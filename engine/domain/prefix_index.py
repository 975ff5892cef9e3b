"""Which agents hold which block-aligned token prefixes (for prefix sharing).

Each complete block of an agent's token list gets a chained key, the hash of
(parent key, block tokens), like nano-vllm's prefix cache: equal keys at
block ``i`` mean (almost certainly) equal prefixes up to the end of block
``i``. Hashes only nominate candidates; the caller compares tokens before
sharing anything, so a collision can never serve the wrong cache.
"""

from __future__ import annotations

from typing import Sequence


def chain_keys(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """One key per complete block of ``tokens``."""
    keys: list[int] = []
    parent = 0
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        parent = hash((parent, tuple(tokens[end - block_tokens : end])))
        keys.append(parent)
    return keys


class PrefixIndex:
    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._holders: dict[int, set[str]] = {}
        self._keys: dict[str, list[int]] = {}

    def update(self, agent_id: str, tokens: Sequence[int]) -> None:
        self.remove(agent_id)
        keys = chain_keys(tokens, self.block_tokens)
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

    def __len__(self) -> int:
        return len(self._keys)
