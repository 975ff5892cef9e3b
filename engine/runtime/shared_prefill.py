"""Early prefix sharing: agents that start together share their common prefix from the first turn.

Prefix sharing (hot_cache.plan_reuse) finds donors among agents whose blocks
are in the pool, and a turn's blocks normally reach the pool when it ends.
When several agents start at once with the same long system prompt, as a
fleet of coding agents does, none of them has finished yet, so each would
prefill the whole prompt itself.

Instead, a turn whose prompt has whole blocks not yet in any cache is fed to
the generator as two segments split at its last whole block (``share_at``).
When the prefill reaches that point, the runner copies those blocks into the
pool as the agent's cache (HotCache.write_blocks, from blocks the turn has
already reserved) and the agent becomes a donor while it is still running.
A waiting turn whose first block matches such a leader's is held back until
then, at most for the rest of the leader's prefill of that prefix, which
it would otherwise have spent computing the same tokens.

Full-attention models only: a sliding-window layer's cache cannot be cut
into shareable whole-prompt blocks mid-prefill.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.domain.cache_spec import ModelCacheSpec

from .agents import AgentRecord, Tier
from .turn import Turn


def supports_early_sharing(spec: ModelCacheSpec) -> bool:
    return all(group.window is None for group in spec.groups)


def share_point(turn: Turn, block_tokens: int) -> int:
    """Where to split the turn's prompt: after its last whole block, if that adds a block to the cache."""
    split = (turn.prompt_len - 1) // block_tokens * block_tokens  # the generator must keep >= 1 token to feed
    return split if split - turn.reused >= block_tokens else 0


def segments(turn: Turn) -> list[list[int]]:
    prompt = list(turn.request.prompt_tokens)
    if not turn.share_at:
        return [prompt[turn.reused:]]
    return [prompt[turn.reused:turn.share_at], prompt[turn.share_at:]]


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
        leader.share_at and not leader.shared_early and leader.request.agent_id != turn.request.agent_id
        and leader.request.prompt_tokens[:block_tokens] == head
        for leader in running
    )
