"""The warm tier's engine-thread half: an agent's cache handed to the store as plain records.

The store (``engine/store/warm_store.py``) writes and reads files on its I/O
thread and knows nothing of agents or pools; this cuts a hot agent's cache
into blocks (copies, so the agent's cache can go at once) or hands over a
cool agent's quantized blocks as they are.
"""

from __future__ import annotations

from concurrent.futures import Future

from engine.runtime.tiers.agents import AgentRecord
from engine.runtime.tiers.cool import at_rest
from engine.store.cold_index import ColdEntry
from engine.store.kv_at_rest import CacheAtRest
from engine.store.warm_store import AgentFile, WarmStore


def spill(store: WarmStore, agent: AgentRecord) -> int:
    """Start writing a hot or cool agent's cache to its file; returns the file's size in bytes."""
    tokens = agent.cool.tokens if agent.cool is not None else agent.tokens
    held = store.holds(agent.agent_id, tokens)
    if held is not None:
        return held  # the file on disk already holds exactly this cache
    cache = _at_rest(store, agent)
    return store.spill(agent_file(agent), cache) if cache is not None else 0


def write_now(store: WarmStore, agent: AgentRecord) -> "Future | None":
    """Make the agent's file current while it stays in memory (an export reads it); the write's future, or
    None when the file holds this cache already."""
    tokens = agent.cool.tokens if agent.cool is not None else agent.tokens
    if store.holds(agent.agent_id, tokens) is not None:
        return None
    cache = _at_rest(store, agent)
    return store.write_now(agent_file(agent), cache) if cache is not None else None


def cold_entry(agent: AgentRecord) -> ColdEntry:
    """What the cold index remembers of an agent whose cache is gone."""
    return ColdEntry(agent.agent_id, agent.stored_tokens or len(agent.tokens), agent.last_used, agent.display_name,
                     agent.source.value)


def agent_file(agent: AgentRecord) -> AgentFile:
    return AgentFile(agent.agent_id, agent.display_name, agent.source.value, agent.created_at, agent.last_used)


def _at_rest(store: WarmStore, agent: AgentRecord) -> CacheAtRest | None:
    if agent.cool is not None:
        return agent.cool  # quantized in memory already: written as it is, whole (no prefix reference)
    if agent.kv is None or not agent.tokens:
        return None
    # A stored shared prefix the agent starts with is referenced, not written again.
    return at_rest(agent.kv, list(agent.tokens), store.shared_prefix_for(agent.tokens))
