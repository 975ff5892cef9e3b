"""Immutable views of engine state for other threads (UI, HTTP, metrics).

The engine thread builds a new EngineSnapshot a few times a second and swaps
one reference; readers never take a lock and never see a half-updated state.
"""

from __future__ import annotations

import time
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal

from engine.domain.block_pool import PoolSnapshot

from engine.domain.forensics import TurnForensics
from engine.domain.speculation_tally import SpeculationTally


# The names an agent's tier and class take in a view (the values of tiers/agents.Tier and domain/priority.AgentClass;
# a test holds them equal).
TierName = Literal["hot", "cool", "warm", "cold", "empty"]
ClassName = Literal["interactive", "main", "side", "subagent", "background"]


def _shown(doc: str, default: Any = MISSING, *, api: bool = True) -> Any:
    """A view field, described once: the workbench reads the field, the HTTP API publishes it with ``doc`` as
    its description (api/agents_schemas.py builds its agent models from these fields) unless ``api`` is False."""
    metadata = {"doc": doc, "api": api}
    return field(metadata=metadata) if default is MISSING else field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class AgentView:
    """One agent as the engine last published it: the one description of an agent that the workbench, the
    agents API and the stream share. The defaults describe an agent that has run no turn here."""

    agent_id: str = _shown("The agent's id")
    display_name: str | None = _shown("A name to show instead of the id (null: the id)", None)
    source: str = _shown("Which client drives it: claude-code, codex, anthropic, openai, api, tui or bench", "api")
    state: str = _shown("idle, queued, prefilling or decoding", "idle")
    tier: TierName = _shown("Where its cache is: hot (in the pool), cool (quantized in the pool), warm (on disk), "
                            "cold (dropped, metadata only) or empty (nothing cached yet)", "empty")
    pinned: bool = _shown("Pinned by the operator: its cache is never evicted", False)
    model_id: str | None = _shown("The model whose cache this is", None, api=False)
    cached_tokens: int = _shown("Tokens whose K/V its cache holds", 0)
    blocks: int = _shown("Pool blocks it holds (hot or cool; 0 otherwise)", 0)
    bytes: int = _shown("Bytes its cache takes: in the pool when hot or cool, on disk when warm", 0)
    turns: int = _shown("Turns run since it was created here", 0)
    reuse_ratio: float = _shown("Of all its prompt tokens, the share served from its cache", 0.0)
    last_ttft_s: float | None = _shown("Its last turn's time to first token, seconds", None)
    decode_tok_s: float | None = _shown("Its last turn's decode rate, tokens a second", None)
    prefill_done: int = _shown("Prompt tokens prefilled of its running turn", 0, api=False)
    prefill_total: int = _shown("Prompt tokens its running turn prefills", 0, api=False)
    last_used: float = _shown("When it last ran a turn (Unix seconds)", 0.0)
    created_at: float = _shown("When it was created (Unix seconds)", 0.0, api=False)
    last_finish: str | None = _shown("How the last turn ended: stop, stop_sequence, length, repetition (a runaway "
                                     "loop cut short), capacity, cancelled, error", None)
    last_finish_note: str | None = _shown("Why, when the server ended it (a loop, the output cap)", None)
    history: tuple[TurnForensics, ...] = _shown("How the last turns met the cache, oldest first", (), api=False)
    retained_s: float = _shown("Seconds left of a client's cache_control retention (Anthropic breakpoints): the "
                               "cache is evicted only after every unmarked agent's", 0.0)
    turn_ends: tuple[int, ...] = _shown("Cached tokens at the end of each turn run since the agent was loaded: "
                                        "what a rewind offers", (), api=False)
    checkpoint_bytes: int = _shown("Of bytes, what checkpoints of the model's sliding or chunked layers, and "
                                   "snapshots of its recurrent layers' state, hold (where a later turn, fork or "
                                   "rewind can resume them)", 0)
    state_bytes: int = _shown("Of bytes, the current state of the model's recurrent layers (Qwen3.5, Mamba, RWKV: "
                              "the same size at any length; 0 for attention-only models)", 0)
    speculation: SpeculationTally = _shown("Speculative decoding over the agent's turns here: drafts verified and "
                                           "kept, acceptance, tokens per speculative step", SpeculationTally())
    last_reasoning_tokens: int = _shown("A thinking model's reasoning tokens in the agent's last turn", 0)
    agent_class: ClassName = _shown("Who the agent is (docs/scheduling.md): read from its client's headers", "main")
    family: str | None = _shown("The session its client's agents group under (a Claude Code session, a Codex root "
                                "thread); null: none", None)
    parent: str | None = _shown("The agent that started it, where its client says", None)
    priority: int = _shown("Its level, 0 most urgent .. 9: its running or queued turn's, else the operator's "
                           "setting, else its class's", 1)
    priority_set: bool = _shown("Whether the operator set the level (POST .../priority)", False)
    paused: bool = _shown("Paused by the operator: its turns wait, its cache stays", False)
    queue_position: int = _shown("Its place among the waiting turns, 1 next; 0: none waiting", 0)
    waiting_on_tool: bool = _shown("Idle while its client runs the tool its last reply called (its cache held hot "
                                   "for tool_loop_hold_s)", False)

    @property
    def label(self) -> str:
        return self.display_name or self.agent_id


@dataclass(frozen=True, slots=True)
class VisionView:
    """A vision model's image work since it loaded: images through the vision tower, images whose kept output
    served a prefill instead, and the tower's time."""

    images_encoded: int = 0
    images_reused: int = 0
    vision_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ClassView:
    """One agent class's recent service (seconds; None: nothing measured yet)."""

    name: str
    turns: int = 0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    gap_p50_s: float | None = None
    gap_p95_s: float | None = None
    gap_max_s: float | None = None


@dataclass(frozen=True, slots=True)
class ThroughputView:
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    batch_size: int = 0
    queue_depth: int = 0
    active_requests: int = 0
    recent_ttft_s: tuple[float, ...] = ()
    generated_total: int = 0
    prefilled_total: int = 0
    reused_total: int = 0
    requests_total: int = 0
    speculation: SpeculationTally = SpeculationTally()  # over every finished turn
    vision: VisionView | None = None  # None: the model has no vision
    classes: tuple[ClassView, ...] = ()  # per agent class, most urgent class first
    # What prefill may take of a step while agents decode (scheduler/prefill_pacer.py): the gap it keeps
    # (None: not measured yet, or no pacing) and the prompt tokens a step carries at that gap.
    gap_target_s: float | None = None
    paced_prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TierView:
    hot_agents: int = 0
    # Idle agents quantized in memory (--kv-bits-at-rest): their pool blocks, and the bits.
    cool_agents: int = 0
    cool_bytes: int = 0
    cool_kv_bits: int | None = None
    warm_agents: int = 0
    cold_agents: int = 0
    hot_bytes: int = 0
    # hot_bytes: the pool's bytes less cool agents' blocks. What the hot caches' arrays measure (own
    # arrays, checkpoints, shared segments once): equal to hot_bytes whenever the engine is between steps.
    hot_array_bytes: int = 0
    warm_bytes: int = 0
    disk_budget_bytes: int = 0
    # Bits of the K/V in warm files written now (--kv-bits, else --kv-bits-at-rest); None: full precision.
    warm_kv_bits: int | None = None
    # The hot pool's K/V (--kv-bits; None: full precision), and one token's bytes over every layer as the pool
    # holds it and at full precision: their ratio is how many more tokens the pool holds.
    hot_kv_bits: int | None = None
    hot_token_bytes: int = 0
    full_token_bytes: int = 0
    # Shared prefixes stored on disk (system prompt + tools), read by new agents instead of prefilled.
    prefix_files: int = 0
    prefix_bytes: int = 0
    shared_blocks: int = 0  # pool blocks held by more than one agent (shared prefixes in memory)
    evictions_total: dict[str, int] = field(default_factory=dict)
    restores_total: int = 0
    discards_total: int = 0
    evictions_per_min: float = 0.0
    restores_per_min: float = 0.0
    prefix_hits: int = 0
    prefix_misses: int = 0
    # prefix_hits split: turns that reused their own agent's cache, and turns that started from a
    # prefix another agent (or a stored shared prefix) held.
    own_hits: int = 0
    shared_hits: int = 0
    # Turns by how they met their agent's cache (forensics.CacheOutcome value -> count).
    cache_outcomes: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class ModelView:
    model_id: str
    identity: str
    path: str | None
    architecture: str
    context_length: int
    spec: dict[str, object]
    # What requests naming no temperature sample with, and where that came from.
    sampling_defaults: str = ""
    # How the batch speculates: off, lookup, or "draft model NAME".
    speculation: str = ""
    # Whether the model reads images: "images (FAMILY, through mlx-vlm)", or "no: WHY".
    vision: str = ""
    # How the hot pool holds K/V: "full precision", or the bits and which layers keep full precision, and why.
    hot_kv: str = ""


@dataclass(frozen=True, slots=True)
class RankView:
    """One rank of a sharded model, as of the last lockstep tick (every rank holds the same blocks,
    each its shard of them, so the pool's block counts are every rank's)."""

    rank: int
    world_size: int
    active_bytes: int  # MLX memory in use on that rank: its weight shard, its pool blocks, buffers
    peak_bytes: int


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    status: str  # "starting", "ready", "swapping", "stopping", "stopped", "failed"
    model: ModelView | None
    pool: PoolSnapshot | None
    agents: tuple[AgentView, ...] = ()
    throughput: ThroughputView = ThroughputView()
    tiers: TierView = TierView()
    backend: dict[str, object] = field(default_factory=dict)
    at: float = field(default_factory=time.time)
    detail: str | None = None
    # A sharded model's ranks (rank 0 first); empty when this process holds the whole model.
    ranks: tuple[RankView, ...] = ()
    # The memory watermarks' latest reading (runtime/memory_pressure.py); None where they are off.
    memory: dict[str, object] | None = None

    def agent(self, agent_id: str) -> AgentView | None:
        return next((a for a in self.agents if a.agent_id == agent_id), None)
