"""Agent records: what the engine knows about each agent, hot or not.

The engine's modules read an AgentRecord's fields freely and change them only
through its methods below (a test holds every module to it): what can happen
to an agent is all here, in its own words, and its tier moves only as
``TIER_MOVES`` allows.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.domain.forensics import HISTORY_KEPT, TurnForensics
from engine.domain.priority import AgentClass, Lineage
from engine.domain.requests import AgentSource, Usage
from engine.domain.speculation_tally import SpeculationTally

if TYPE_CHECKING:
    from engine.store.kv_at_rest import CacheAtRest
    from engine.runtime.runner.kv.sequence_kv import SequenceKV


class AgentState(str, enum.Enum):
    IDLE = "idle"
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"


class Tier(str, enum.Enum):
    HOT = "hot"  # blocks in the pool
    COOL = "cool"  # quantized in memory, paid for in pool blocks (tiers/cool.py)
    WARM = "warm"  # on disk
    COLD = "cold"  # dropped; metadata only
    EMPTY = "empty"  # nothing cached yet


# Where an agent's cache may go from each tier. An agent's tier changes only through AgentRecord.move_to,
# which holds it to this table. Every tier may become hot (a turn's cache, a restore), warm (a spill, an
# import), cold (a drop, a file lost) or empty (a rewind to nothing, a fresh cache given back); only a hot
# cache quantized in the pool becomes cool (tiers/cool.py), and a cool one that could not come back stays cool.
TIER_MOVES: dict[Tier, frozenset[Tier]] = {
    Tier.EMPTY: frozenset({Tier.EMPTY, Tier.HOT, Tier.WARM, Tier.COLD}),
    Tier.HOT: frozenset({Tier.HOT, Tier.COOL, Tier.WARM, Tier.COLD, Tier.EMPTY}),
    Tier.COOL: frozenset({Tier.COOL, Tier.HOT, Tier.WARM, Tier.COLD, Tier.EMPTY}),
    Tier.WARM: frozenset({Tier.WARM, Tier.HOT, Tier.COLD, Tier.EMPTY}),
    Tier.COLD: frozenset({Tier.COLD, Tier.HOT, Tier.WARM, Tier.EMPTY}),
}


class IllegalTierMove(RuntimeError):
    """A tier change the table does not allow: a bug in the engine, never a client's doing."""


@dataclass(slots=True)
class AgentRecord:
    agent_id: str
    source: AgentSource = AgentSource.API
    display_name: str | None = None
    model_id: str | None = None
    # The tokens whose K/V the resident cache holds, position for position.
    tokens: list[int] = field(default_factory=list)
    kv: "SequenceKV | None" = None
    # Pool blocks paying for ``kv`` per layer group (a cool agent's: for ``cool``, under group 0).
    blocks: dict[int, list[int]] = field(default_factory=dict)
    # The quantized cache of a cool agent (tier COOL); None otherwise.
    cool: "CacheAtRest | None" = None
    tier: Tier = Tier.EMPTY
    state: AgentState = AgentState.IDLE
    pinned: bool = False
    # Agents created by short side requests (titles, probes): evicted first,
    # and never allowed to evict a main conversation.
    auxiliary: bool = False
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    # Monotonic LRU clock: wall time can jump, this cannot.
    lru_tick: int = 0
    active_requests: int = 0
    turns: int = 0
    prompt_tokens_total: int = 0
    reused_tokens_total: int = 0
    prefill_done: int = 0
    prefill_total: int = 0
    last_ttft_s: float | None = None
    last_decode_tok_s: float | None = None
    # A thinking model's reasoning tokens in the last turn, and over all its turns here.
    last_reasoning_tokens: int = 0
    reasoning_tokens_total: int = 0
    # Speculative decoding over every turn of this agent since it was created here.
    speculation: SpeculationTally = SpeculationTally()
    # How the last turn ended (FinishReason value) and, when the engine ended it, why.
    last_finish: str | None = None
    last_finish_note: str | None = None
    generated_tokens_total: int = 0
    # Cached token count while warm/cold (the hot count is len(tokens)).
    stored_tokens: int = 0
    stored_bytes: int = 0
    # Until when (time.monotonic) a client's cache_control breakpoint asks to keep this cache;
    # eviction passes over the agent while any unmarked agent can go instead.
    retained_until: float = 0.0
    # Who the agent is to the person at the machine (its latest request says), and what the operator set:
    # a level that overrides its requests' and class's (None: none), and whether its turns are paused.
    agent_class: AgentClass = AgentClass.MAIN
    lineage: Lineage = Lineage()
    priority: int | None = None
    paused: bool = False
    # The level its latest request asked for (None: none asked).
    asked_priority: int | None = None
    # Until when (time.monotonic) its client runs the tool its last reply called (the cache is held meanwhile).
    tool_hold_until: float = 0.0
    # Cached tokens at the end of each turn run since the agent was last loaded: where a fork or a
    # rewind "at turn N" cuts (runtime/tiers/branching.py).
    turn_ends: list[int] = field(default_factory=list)
    # How the last turns met the cache (domain/forensics.py), oldest first.
    history: "deque[TurnForensics]" = field(default_factory=lambda: deque(maxlen=HISTORY_KEPT))

    # -- who it is ----------------------------------------------------------------------------
    def identify(self, display_name: str | None, agent_class: AgentClass, lineage: Lineage,
                 asked_priority: int | None) -> None:
        """What its latest request says it is (a name to show, where it gives one and none was given before)."""
        if display_name and not self.display_name:
            self.display_name = display_name
        self.agent_class, self.lineage, self.asked_priority = agent_class, lineage, asked_priority

    def known_since(self, created_at: float, last_used: float) -> None:
        """Its times as an earlier run or a file recorded them."""
        self.created_at, self.last_used = created_at, last_used

    def seeded(self, pinned: bool, created_at: float, last_used: float, model_id: str | None) -> None:
        """What the engine before a model swap knew of it (a turn under this model then reports model_changed)."""
        self.pinned, self.model_id = pinned, model_id
        self.known_since(created_at, last_used)

    def first_request(self, auxiliary: bool) -> None:
        """A new (or cold) agent's first turn says whether it is a side request's: evicted first."""
        self.auxiliary = auxiliary

    # -- what the operator sets ---------------------------------------------------------------
    def pin(self, pinned: bool) -> None:
        self.pinned = pinned

    def set_priority(self, level: int | None) -> None:
        """A level that overrides its requests' and class's (None: back to theirs)."""
        self.priority = level

    def set_paused(self, paused: bool) -> None:
        self.paused = paused

    def hold_for_tool(self, until: float) -> None:
        """Its client runs the tool its last reply called until ``until`` (clock.now()): the cache is held."""
        self.tool_hold_until = until

    # -- its turns ----------------------------------------------------------------------------
    def queued(self) -> None:
        self.state = AgentState.QUEUED

    def turn_started(self, to_prefill: int) -> None:
        """A turn entered the batch with ``to_prefill`` prompt tokens to read."""
        self.active_requests += 1
        self.state = AgentState.PREFILLING
        self.prefill_done, self.prefill_total = 0, to_prefill

    def prefilled(self, done: int) -> None:
        self.prefill_done = done

    def decoding(self, prefilled: int) -> None:
        """Its turn's first token came: the prompt (``prefilled`` tokens to read) is all in."""
        self.state = AgentState.DECODING
        self.prefill_done = prefilled

    def turn_left(self) -> None:
        """A turn left the batch."""
        self.active_requests = max(0, self.active_requests - 1)

    def settle_state(self, waiting: bool) -> None:
        """Between turns: queued when another of its turns waits, else idle (nothing while one runs)."""
        if not self.is_busy:
            self.state = AgentState.QUEUED if waiting else AgentState.IDLE

    def record_turn(self, finish: str, note: str | None, usage: Usage) -> None:
        """A turn ended (``finish``: the FinishReason's value; ``note``: why, when the server ended it)."""
        self.last_finish, self.last_finish_note = finish, note
        self.turns += 1
        self.prompt_tokens_total += usage.prompt_tokens
        self.reused_tokens_total += usage.reused_tokens
        self.generated_tokens_total += usage.generated_tokens
        self.last_reasoning_tokens = usage.reasoning_tokens
        self.reasoning_tokens_total += usage.reasoning_tokens
        self.last_ttft_s, self.last_decode_tok_s = usage.ttft_s, usage.decode_tok_s
        if usage.speculation is not None:
            self.speculation = self.speculation + usage.speculation
        self.prefill_done = self.prefill_total = 0

    # -- its cache ----------------------------------------------------------------------------
    def holds(self, tokens: list[int], model_id: str | None = None) -> None:
        """Its resident cache holds the K/V of ``tokens`` (computed by ``model_id``, where given)."""
        self.tokens = tokens
        if model_id is not None:
            self.model_id = model_id

    def hold_kv(self, kv: "SequenceKV") -> None:
        self.kv = kv

    def take_blocks(self, blocks: dict[int, list[int]]) -> None:
        """The pool blocks that pay for its cache now."""
        self.blocks = blocks

    def let_go(self) -> None:
        """Its resident cache and the blocks paying for it are given back."""
        self.blocks, self.kv = {}, None

    def turn_ended_at(self, reused: int) -> None:
        """A turn that reused ``reused`` tokens ended with the cache at its tokens: a fork or a rewind can cut
        there."""
        self.turn_ends = [end for end in self.turn_ends if end <= reused] + [len(self.tokens)]

    def keep_turn_ends(self, up_to: int, ends: list[int] | None = None) -> None:
        """Its turn ends (``ends``, its own where None) up to ``up_to`` cached tokens (a rewind, a fork, a cache
        read back without them: [])."""
        self.turn_ends = [end for end in (self.turn_ends if ends is None else ends) if end <= up_to]

    def cooled(self, blocks: dict[int, list[int]], cool: "CacheAtRest", n_tokens: int) -> None:
        """Its hot cache was quantized in the pool: ``cool`` holds ``n_tokens``, paid for by ``blocks``."""
        self.blocks, self.cool = blocks, cool
        self.move_to(Tier.COOL)
        self.stored_tokens, self.stored_bytes = n_tokens, cool.nbytes

    def uncooled(self) -> None:
        """Its quantized copy is gone (restored hot, spilled or dropped)."""
        self.cool = None

    def stored(self, n_tokens: int, nbytes: int) -> None:
        """What its cache out of the pool holds: ``n_tokens`` in ``nbytes`` (on disk when warm)."""
        self.stored_tokens, self.stored_bytes = n_tokens, nbytes

    def went_cold(self) -> None:
        """Its cache is gone (its file deleted or never written): listed, nothing stored."""
        self.move_to(Tier.COLD)
        self.stored_bytes = 0

    def move_to(self, tier: Tier) -> None:
        """The agent's cache is now in ``tier`` (the one place a tier changes: ``TIER_MOVES`` says where from)."""
        if tier not in TIER_MOVES[self.tier]:
            raise IllegalTierMove(f"agent {self.agent_id!r}: {self.tier.value} -> {tier.value} is not a tier move")
        self.tier = tier

    @property
    def is_busy(self) -> bool:
        return self.active_requests > 0

    def retained_for(self, now: float) -> float:
        """Seconds of client-asked retention left (0: none)."""
        return max(0.0, self.retained_until - now)

    def retain(self, seconds: float, now: float) -> None:
        if seconds > 0:
            self.retained_until = max(self.retained_until, now + seconds)

    @property
    def cached_tokens(self) -> int:
        return len(self.tokens) if self.tier is Tier.HOT else self.stored_tokens

    @property
    def reuse_ratio(self) -> float:
        if self.prompt_tokens_total == 0:
            return 0.0
        return self.reused_tokens_total / self.prompt_tokens_total

    @property
    def owner(self) -> str:
        return self.agent_id

    def hot_block_ids(self) -> list[int]:
        """Every pool block the agent holds: its own, and its holds on shared segments."""
        own = [b for group in sorted(self.blocks) for b in self.blocks[group]]
        shared = [b for seg in self.kv.segments for b in seg.block_ids] if self.kv is not None else []
        return own + shared

    def touch(self, tick: int) -> None:
        self.last_used = time.time()
        self.lru_tick = tick


def agent_source(value: str | None) -> AgentSource:
    """The client kind a file or an earlier engine recorded (an unknown or missing one: the direct API)."""
    try:
        return AgentSource(value)
    except ValueError:
        return AgentSource.API
