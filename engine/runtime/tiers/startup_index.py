"""The agents a starting engine knows before its first turn: those whose caches earlier runs left on
disk (warm files, the cold index) and those an engine before a model swap handed over (seeds).

Warm agents resume from their files; cold ones are listed with what they held; a seed keeps its identity
(name, pin, the model it last ran on, so its next turn reports the model change) where this model holds
nothing for it yet. Under a sharded model each rank keeps only the warm agents every rank holds a shard
of, and every rank lists rank 0's cold agents (``whole_shards``, ``rank0s``: the agent tables must match).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from engine.domain.event_log import EventKind, EventLog
from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.agents import AgentRecord, Tier, agent_source

if TYPE_CHECKING:
    from engine.store.warm_store import WarmStore


def index_agents(agents: AgentTable, store: "WarmStore | None", seeds: Iterable[Any], events: EventLog,
                 whole_shards: Callable[[list[Any]], list[Any]] = lambda headers: headers,
                 rank0s: Callable[[Any], Any] = lambda value: value) -> None:
    """Fill ``agents`` from the disk, then from ``seeds`` (``AgentView``s of the engine before a swap)."""
    if store is not None:
        _index_disk(agents, store, events, whole_shards, rank0s)
    for seed in seeds:
        if seed.agent_id not in agents:
            record = agents.add(AgentRecord(seed.agent_id, agent_source(seed.source), seed.display_name))
            record.seeded(seed.pinned, seed.created_at, seed.last_used, seed.model_id)
        else:
            agents.get(seed.agent_id).pin(seed.pinned)


def _index_disk(agents: AgentTable, store: "WarmStore", events: EventLog,
                whole_shards: Callable[[list[Any]], list[Any]], rank0s: Callable[[Any], Any]) -> None:
    for header in whole_shards(store.scan()):
        record = agents.add(AgentRecord(header.agent_id, agent_source(header.source), header.display_name))
        record.move_to(Tier.WARM)
        record.stored(header.n_tokens, store.entries[header.agent_id].nbytes)
        record.known_since(header.created_at, header.last_used)
    for entry in rank0s(store.cold.entries()):
        if entry.agent_id not in agents:
            record = agents.add(AgentRecord(entry.agent_id, agent_source(entry.source), entry.display_name))
            record.stored(entry.n_tokens, 0)
            record.known_since(record.created_at, entry.last_used)
            record.move_to(Tier.COLD)
    if len(agents):
        events.emit(EventKind.RESTORE, f"indexed {len(agents)} agents from {store.directory}")
