"""Immutable views of engine state for other threads (UI, HTTP, metrics).

The engine thread builds a new EngineSnapshot a few times a second and swaps
one reference; readers never take a lock and never see a half-updated state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.domain.block_pool import PoolSnapshot

from engine.domain.forensics import TurnForensics
from engine.domain.speculation_tally import SpeculationTally


@dataclass(frozen=True, slots=True)
class AgentView:
    agent_id: str
    display_name: str | None
    source: str
    state: str
    tier: str
    pinned: bool
    model_id: str | None
    cached_tokens: int
    blocks: int
    bytes: int
    turns: int
    reuse_ratio: float
    last_ttft_s: float | None
    decode_tok_s: float | None
    prefill_done: int
    prefill_total: int
    last_used: float
    created_at: float
    # How the last turn ended (stop, length, repetition, capacity, error...) and why, when the
    # engine or a server limit ended it rather than the model.
    last_finish: str | None = None
    last_finish_note: str | None = None
    # How the last turns met the cache, oldest first (forensics.TurnForensics).
    history: tuple[TurnForensics, ...] = ()
    # Seconds left of a client's cache_control retention (0: none).
    retained_s: float = 0.0
    # Cached tokens at the end of each turn run since the agent was loaded: what a rewind offers.
    turn_ends: tuple[int, ...] = ()
    # Of ``bytes``, what the checkpoints of its window layers hold (sliding or chunked; hot agents only),
    # and for recurrent layers (Qwen3.5, Mamba...) the snapshots of their state.
    checkpoint_bytes: int = 0
    # Of ``bytes``, its recurrent layers' current state (the same at any length; hot agents only).
    state_bytes: int = 0
    # Speculative decoding over its turns here (drafts verified and kept, tokens per speculative step).
    speculation: SpeculationTally = SpeculationTally()
    # A thinking model's reasoning tokens in the agent's last turn (0: none, or not a thinking model).
    last_reasoning_tokens: int = 0
    # Scheduling (domain/priority.py): its class, the session it groups under and its parent agent, its level
    # (the operator's, its running or queued turn's, else its class's) and whether the operator set it, whether
    # it is paused, and its place among the waiting turns (0: none waiting).
    agent_class: str = "main"
    family: str | None = None
    parent: str | None = None
    priority: int = 1
    priority_set: bool = False
    paused: bool = False
    queue_position: int = 0
    # Idle while its client runs the tool its last reply called (its cache held hot meanwhile).
    waiting_on_tool: bool = False

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
