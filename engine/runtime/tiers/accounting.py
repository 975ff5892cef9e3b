"""What the hot tier's arrays really occupy, to check against what the pool counts.

The pool counts blocks; the arrays are the truth. ``held_bytes`` adds up the
arrays of every hot agent's cache (own arrays, checkpoints, and each shared
segment once), so tests and the admin stats can assert the two agree.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.runtime.tiers.agents import AgentRecord


def held_bytes(agents: Iterable[AgentRecord]) -> int:
    total = 0
    segments: dict[int, int] = {}
    for agent in agents:
        if agent.kv is None:
            continue
        total += agent.kv.array_bytes()
        for segment in agent.kv.segments:
            segments[id(segment)] = segment.array_bytes()
    return total + sum(segments.values())
