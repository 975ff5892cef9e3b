"""What clients may do to agents on the engine thread: evict, pin, delete, fork, rewind, export, import, and
set their priority, pause them and hold their cache through a tool loop.

These are the commands a sharded model's ranks replay (each ``engine_ops.EngineOp``
calls one of these methods), so they are a small explicit set, each a method
here; the engine keeps the thread, the door and the loop. Engine-thread only:
reach them through ``Engine.call(EvictAgent(...))`` and the other ops of engine_ops.py.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engine.domain.event_log import EventKind, EventLog
from engine.domain.requests import AgentSource
from engine.errors import AgentExistsError, AgentNotFoundError, EngineUnavailableError
from engine.runtime import clock
from engine.runtime.tiers import warm
from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.agents import AgentRecord, Tier, agent_source
from engine.runtime.tiers.branching import Branch, Branching
from engine.runtime.tiers.hot import HotCache
from engine.runtime.tiers.manager import TierManager

if TYPE_CHECKING:
    from engine.runtime.scheduler.priorities import Priorities
    from engine.store.warm_store import WarmStore

class AgentOps:
    def __init__(self, agents: AgentTable, hot: HotCache, tiers: TierManager, events: EventLog,
                 store: "WarmStore | None", shard: tuple[int, int] | None) -> None:
        self.agents = agents
        self.hot = hot
        self.tiers = tiers
        self.events = events
        self.store = store
        self.shard = shard  # (rank, ranks) of a sharded model; None: this process holds the whole model
        self.branching = Branching(hot, agents, tiers, events)
        # The scheduler's priorities, once the engine thread has built it (None before: nothing is queued).
        self.priorities: "Priorities | None" = None

    def evict_agent(self, agent_id: str, tier: Tier) -> None:
        agent = self._agent(agent_id)
        if agent.is_busy:
            raise EngineUnavailableError(f"agent {agent_id!r} is generating; evict it when idle", retry_after_s=1)
        self.tiers.evict(agent, tier, reason="requested")

    def evict_idle(self, tier: Tier = Tier.WARM) -> int:
        victims = self.agents.eviction_order(protect=set())
        for agent in victims:
            self.tiers.evict(agent, tier, reason="evict all idle")
        return len(victims)

    def pin_agent(self, agent_id: str, pinned: bool) -> None:
        self._agent(agent_id).pin(pinned)

    def delete_agent(self, agent_id: str) -> None:
        agent = self._agent(agent_id)
        if agent.is_busy:
            raise EngineUnavailableError(f"agent {agent_id!r} is generating", retry_after_s=1)
        self.hot.drop(agent)
        agent.uncooled()
        if self.store is not None:
            self.store.forget(agent_id)
            self.store.forget_cold(agent_id)
        self.agents.remove(agent_id)
        self.events.emit(EventKind.INFO, f"{agent_id}: deleted", agent_id)

    def set_agent_priority(self, agent_id: str, level: int | None) -> None:
        """The operator's level for the agent (None: its requests' and class's again); its turns move now."""
        agent = self._agent(agent_id)
        if self.priorities is not None:
            self.priorities.set_level(agent, level)
        else:
            agent.set_priority(level)

    def pause_agent(self, agent_id: str, paused: bool) -> None:
        """Pause (its turns wait, its cache stays) or resume an agent."""
        agent = self._agent(agent_id)
        if self.priorities is not None:
            self.priorities.set_paused(agent, paused)
        else:
            agent.set_paused(paused)

    def hold_agent(self, agent_id: str, seconds: float) -> None:
        """Keep the agent's cache hot for ``seconds`` while other idle caches can go first (a tool loop: its
        client runs the tool and comes back); an agent gone already is no error."""
        agent = self.agents.get(agent_id)
        if agent is not None:
            agent.retain(seconds, clock.now())
            agent.hold_for_tool(clock.now() + seconds)

    def fork_agent(self, source_id: str, new_id: str, turn: int | None = None,
                   prompt: tuple[int, ...] | None = None, display_name: str | None = None,
                   source_kind: AgentSource | None = None) -> Branch:
        """A new agent starting from ``source_id``'s cache (tiers/branching.py)."""
        return self.branching.fork(source_id, new_id, turn, prompt, display_name, source_kind)

    def rewind_agent(self, agent_id: str, turn: int | None = None, prompt: tuple[int, ...] | None = None) -> Branch:
        """Cut an agent's cache back to the end of an earlier turn (tiers/branching.py)."""
        return self.branching.rewind(agent_id, turn, prompt)

    def write_agent(self, agent_id: str) -> "Future[Any] | None":
        """Make the agent's warm file current (an export reads it); the pending write's future, or
        None when the file is current already. The agent stays where it is."""
        agent = self._agent(agent_id)
        self._refuse_when_sharded("exporting an agent")
        if self.store is None or not self.store.usable:
            raise EngineUnavailableError("this server has no cache directory to export from (--no-persist?)")
        if agent.is_busy:
            raise EngineUnavailableError(f"agent {agent_id!r} is generating; export it when idle", retry_after_s=1)
        if (agent.tier is Tier.HOT and agent.tokens) or agent.tier is Tier.COOL:
            return warm.write_now(self.store, agent)
        if agent.tier is not Tier.WARM:
            raise AgentNotFoundError(agent_id, f"agent {agent_id!r} has no cache to export (tier {agent.tier.value})")
        return None

    def check_import(self, agent_id: str, replace: bool) -> None:
        """Refuse an import over an agent this engine has, unless asked to replace an idle one."""
        self._refuse_when_sharded("importing an agent")
        if self.store is None or not self.store.usable:
            raise EngineUnavailableError("this server has no cache directory to import into")
        agent = self.agents.get(agent_id)
        if agent is None:
            return
        if not replace:
            raise AgentExistsError(agent_id)
        if agent.is_busy:
            raise EngineUnavailableError(f"agent {agent_id!r} is generating; replace it when idle", retry_after_s=1)
        self.store.finish_write(agent_id)

    def adopt_agent(self, path: Any) -> str:
        """Index a warm file an import just wrote into this model's folder (replacing the agent's
        cache if it had one); returns its agent id."""
        assert self.store is not None
        header = self.store.adopt(path)
        agent_id = header.agent_id
        agent = self.agents.get(agent_id)
        if agent is not None:
            self.check_import(agent_id, replace=True)
            self.hot.drop(agent)
            agent.uncooled()
        else:
            agent = self.agents.add(AgentRecord(agent_id, agent_source(header.source), header.display_name))
        agent.move_to(Tier.WARM)
        agent.stored(header.n_tokens, self.store.entries[agent_id].nbytes)
        agent.known_since(header.created_at, header.last_used)
        agent.keep_turn_ends(0, [])
        self.events.emit(EventKind.RESTORE, f"{agent_id}: imported, {header.n_tokens} tokens on disk", agent_id)
        return agent_id

    def _refuse_when_sharded(self, what: str) -> None:
        # An export file holds one process's whole cache; a sharded agent's cache is one file per rank.
        if self.shard is not None:
            raise EngineUnavailableError(f"{what} is not available while the model is sharded across "
                                         f"{self.shard[1]} ranks (each rank holds a shard of its cache)")

    def _agent(self, agent_id: str) -> AgentRecord:
        agent = self.agents.get(agent_id)
        if agent is None:
            raise AgentNotFoundError(agent_id)
        return agent
