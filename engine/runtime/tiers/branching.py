"""Forking and rewinding agents: new branches of a context without prefilling it again.

A **fork** is a new agent whose cache starts as another agent's, at its end or
at the end of one of its turns. The source's whole blocks become shared
segments held by both (``HotCache.share_prefix``: by reference, counted once
in the pool); only the partial block after them, and the sliding-window
layers' rings, are copied. Each side writes its own positions from there on,
so nothing else is copied until the branches diverge.

A **rewind** takes an agent back to the end of an earlier turn: its cache is
cut there (``HotCache.continue_own``; a sliding-window layer can go back only
to a checkpoint, so the cut may land earlier and the next turn computes the
difference).

Where to cut is given either as a turn number, from the token count the
engine recorded at the end of each turn (``AgentRecord.turn_ends``; known for
turns run since the agent was last loaded in this process), or as a prompt:
the cut is then the longest prefix of the cache that prompt starts with. The
direct API passes the rendering of the conversation cut at that turn, which
works after a restart too.

Every function runs on the engine thread (``Engine.call``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.domain.block_layout import common_prefix_length
from engine.errors import (
    AgentExistsError,
    AgentNotFoundError,
    EngineUnavailableError,
    InvalidRequestError,
    PoolExhaustedError,
)

from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.domain.event_log import EventKind, EventLog
from engine.runtime.tiers.hot import HotCache
from engine.domain.requests import AgentSource
from engine.runtime.tiers.manager import HotState, TierManager


@dataclass(frozen=True, slots=True)
class Branch:
    """What a fork or a rewind left: the agent, its cached tokens, how many of them are shared blocks."""

    agent_id: str
    tokens: int
    shared_tokens: int
    copied_bytes: int
    asked_tokens: int  # where the cut was asked for (``tokens`` is less when a window layer could not go there)


class Branching:
    def __init__(self, hot: HotCache, agents: AgentTable, tiers: TierManager, events: EventLog) -> None:
        self.hot = hot
        self.agents = agents
        self.tiers = tiers
        self.events = events

    # -- fork ------------------------------------------------------------------------------
    def fork(self, source_id: str, new_id: str, turn: int | None = None,
             prompt: tuple[int, ...] | None = None, display_name: str | None = None,
             source_kind: AgentSource | None = None) -> Branch:
        """``source_kind``: who drives the fork (default: the same kind of client as the source)."""
        source = self._idle_hot(source_id)
        if new_id in self.agents:
            raise AgentExistsError(new_id)
        asked = self._cut(source, turn, prompt)
        n = source.kv.resumable_at(asked) if source.kv is not None and asked else 0
        fork = self.agents.add(AgentRecord(new_id, source_kind or source.source,
                                           display_name or f"fork of {source_id}", model_id=source.model_id))
        self.agents.touch(fork)
        if n == 0:
            return Branch(new_id, 0, 0, 0, asked)
        self.hot.fresh(fork)
        shared, copied = self.hot.share_prefix(fork, source, n)
        if not self._reserve(fork, n, protect={source_id, new_id}):
            self.hot.release(fork)
            self.agents.remove(new_id)
            raise PoolExhaustedError(f"no pool room for the {n - shared} own positions of a fork of {source_id!r}")
        assert source.kv is not None and fork.kv is not None
        copied += self.hot.copy_prefix(fork, source.kv, n)
        fork.holds(list(source.tokens[:n]))
        fork.keep_turn_ends(n, source.turn_ends)
        fork.move_to(Tier.HOT)
        self.hot.publish(fork)
        self.events.emit(EventKind.SHARE, f"{new_id}: forked from {source_id} at token {n} "
                         f"({shared} shared by reference)", new_id)
        return Branch(new_id, n, shared, copied, asked)

    # -- rewind ----------------------------------------------------------------------------
    def rewind(self, agent_id: str, turn: int | None = None, prompt: tuple[int, ...] | None = None) -> Branch:
        agent = self._idle_hot(agent_id)
        asked = self._cut(agent, turn, prompt)
        if agent.kv is None:
            return Branch(agent_id, 0, 0, 0, asked)
        before = agent.kv.copied
        kept = self.hot.continue_own(agent, agent.kv.resumable_at(asked) if asked else 0)
        self.hot.tidy(agent)
        if kept == 0:
            self.hot.drop(agent)
            agent.move_to(Tier.EMPTY)
        agent.keep_turn_ends(kept)
        self.events.emit(EventKind.INFO, f"{agent_id}: rewound to token {kept}"
                         + (f" (turn {turn})" if turn is not None else ""), agent_id)
        shared = agent.kv.base if agent.kv is not None else 0
        copied = agent.kv.copied - before if agent.kv is not None else 0
        return Branch(agent_id, kept, shared, copied, asked)

    # -- shared steps ----------------------------------------------------------------------
    def _idle_hot(self, agent_id: str) -> AgentRecord:
        """The agent, idle, with its cache in the pool (read back from disk if it was evicted)."""
        agent = self.agents.get(agent_id)
        if agent is None:
            raise AgentNotFoundError(agent_id)
        if agent.is_busy:
            raise EngineUnavailableError(f"agent {agent_id!r} is generating; fork or rewind it when idle",
                                         retry_after_s=1)
        self.agents.touch(agent)
        state = self.tiers.ensure_hot(agent, protect={agent_id})
        if state is HotState.PENDING:
            raise CacheStillLoading(agent_id)
        if state is HotState.NO_ROOM:
            raise PoolExhaustedError(f"no pool room to bring {agent_id!r} back from disk")
        return agent

    def _cut(self, agent: AgentRecord, turn: int | None, prompt: tuple[int, ...] | None) -> int:
        if prompt is not None:
            return min(common_prefix_length(agent.tokens, prompt), len(agent.tokens))
        if turn is None:
            return len(agent.tokens)
        ends = [end for end in agent.turn_ends if end <= len(agent.tokens)]
        if not 0 <= turn <= len(ends):
            known = f"turns 0-{len(ends)}" if ends else "only turn 0 (its turns ran before it was last loaded)"
            raise InvalidRequestError(f"turn {turn} is out of range: agent {agent.agent_id!r} has {known}",
                                      field="turn")
        return ends[turn - 1] if turn else 0

    def _reserve(self, holder: AgentRecord, n_tokens: int, protect: set[str]) -> bool:
        if self.hot.ensure(holder, n_tokens):
            return True
        self.tiers.make_room(self.hot.missing_blocks(holder, n_tokens), protect)
        return self.hot.ensure(holder, n_tokens)


class CacheStillLoading(EngineUnavailableError):
    """The agent's cache is being read from disk: ask again in a moment (the API does)."""

    def __init__(self, agent_id: str) -> None:
        super().__init__(f"agent {agent_id!r} is being read back from disk", retry_after_s=1)
