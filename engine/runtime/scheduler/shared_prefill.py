"""Early prefix sharing: agents that start together share their common prefix from the first turn.

Prefix sharing (hot_cache.plan_reuse) copies a prefix out of another agent's
resident cache, and a turn's tokens are normally offered to others when it
ends. When several agents start at once with the same long system prompt, as
a fleet of coding agents does, none of them has finished yet, so each would
prefill the whole prompt itself.

Instead, a turn whose prompt has whole blocks beyond what it reused offers its
cache as soon as its prefill passes its last whole block (``share_at``; the
prefill chunk ends exactly there, and models with sliding-window layers take
a checkpoint of those layers at that position). A waiting turn whose first
block matches such a leader's, and that is no more urgent than it, is held back until then, at most for the rest
of the leader's prefill of that prefix, which it would otherwise have spent
computing the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.runtime.scheduler.turn import Turn


def share_point(turn: Turn, block_tokens: int) -> int:
    """Where to offer the cache: after the prompt's last whole block, if that adds a block to it."""
    split = (turn.prompt_len - 1) // block_tokens * block_tokens  # the batch feeds the last token itself
    return split if split - turn.reused >= block_tokens else 0


def first_block(prompt: tuple[int, ...], block_tokens: int) -> tuple[int, ...] | None:
    return prompt[:block_tokens] if len(prompt) > block_tokens else None


def awaits_leader(turn: Turn, agent: AgentRecord | None, running: Iterable[Turn], block_tokens: int) -> bool:
    """Whether ``turn`` should wait for a running turn that is about to share the prefix it starts with."""
    head = first_block(turn.request.prompt_tokens, block_tokens)
    if head is None:
        return False
    if agent is not None and (agent.tier is Tier.WARM or tuple(agent.tokens[:block_tokens]) == head):
        return False  # its own cache (in the pool or on disk) serves it better
    return any(
        leader.share_at and not leader.published and leader.request.agent_id != turn.request.agent_id
        and leader.level <= turn.level  # never held behind a less urgent leader's (paced) prefill
        and leader.request.prompt_tokens[:block_tokens] == head
        for leader in running
    )
