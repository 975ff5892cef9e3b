"""What clients send to the engine and what they get back, as plain values."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, replace
from typing import Callable, Literal

from engine.domain.images import PromptImage
from engine.domain.output_format import OutputFormat
from engine.domain.priority import AgentClass, Lineage
from engine.domain.reasoning import CallText
from engine.domain.speculation_tally import SpeculationTally

_request_ids = itertools.count(1)


def next_request_id() -> str:
    return f"req-{next(_request_ids)}"


class AgentSource(str, enum.Enum):
    """Who drives an agent; shown in the UI's agent table."""

    TUI = "tui"
    CLAUDE_CODE = "claude-code"
    CODEX = "codex"
    ANTHROPIC = "anthropic"
    OPENAI = "openai"
    API = "api"
    BENCH = "bench"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One turn of one agent: the whole prompt as token ids.

    The engine finds how much of ``prompt_tokens`` the agent already has
    cached and prefills only the rest.
    """

    agent_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_strings: tuple[str, ...] = ()
    # Next-speaker markers of a prompt format without a chat template (``\n\nUser:``): the reply
    # ends before one, reported as an ordinary end of turn (rendering.py, text_stream.py).
    turn_end_strings: tuple[str, ...] = ()
    source: AgentSource = AgentSource.API
    display_name: str | None = None
    model_id: str | None = None
    # Auxiliary requests (titles, probes) never evict a main conversation and
    # do not replace the agent's cache when they finish.
    auxiliary: bool = False
    # What the client asked for when the server's output cap clamped ``max_tokens``.
    asked_max_tokens: int | None = None
    # How many leading prompt tokens other agents are likely to share (the rendered system prompt
    # and tools): the engine checkpoints there and stores that prefix for later agents. 0: unknown.
    prefix_hint: int = 0
    # How many leading prompt tokens are the rendered system prompt and tools (0: unknown); cache
    # forensics use it to say whether a divergence lies there or in the messages.
    head_tokens: int = 0
    # The client's cache_control breakpoints (Anthropic): keep this agent's cache for ``retain_s``
    # seconds in preference to unmarked agents when the pool needs room. ``retain_tokens``: how many
    # leading prompt tokens lie before the last breakpoint (the usage's cache-creation split).
    retain_s: float = 0.0
    retain_tokens: int = 0
    # Structured outputs: the reply is constrained to JSON that validates against this schema (None: free text).
    output_format: OutputFormat | None = None
    # A thinking model's reasoning: at most this many tokens, then the end marker is written (None: no limit but
    # max_tokens; 0: none). Models without a reasoning format ignore it.
    reasoning_budget: int | None = None
    # Where the reply begins as a later prompt may render it, when the template's generation prompt opened the
    # reasoning (``<think>\n``): the next turn's template may drop this turn's reasoning and with it those opening
    # tokens, so the turn's checkpoint (window and recurrent layers) is taken there rather than one token short of
    # the prompt's end. 0: one short of the end.
    reply_start: int = 0
    # A raw completion's reply: the model's text whole, no reasoning told apart (a thinking model's markers stay).
    plain_text: bool = False
    # The prompt's images (a vision model's): where each run of image tokens lies and what the vision tower takes.
    images: tuple[PromptImage, ...] = ()
    # Who the agent is to the person at the machine, and its place in its client's tree (domain/priority.py).
    agent_class: AgentClass = AgentClass.MAIN
    lineage: Lineage = Lineage()
    # The level the request asked for (0 most urgent .. 9); None: its agent's or its class's.
    priority: int | None = None
    request_id: str = field(default_factory=next_request_id)
    # The engine that checked and clamped it (``Engine.validate``): submitted there, it is not checked again.
    validated_by: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError("prompt_tokens must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise ValueError(f"reasoning_budget must be >= 0, got {self.reasoning_budget}")


def clamped(request: GenerationRequest, max_output_tokens: int, context_room: int) -> GenerationRequest:
    """``request`` with ``max_tokens`` clamped, the one rule for it: to the server's ``max_output_tokens`` (the
    request then records what it asked, for the client's header and the agent's note) and to the context
    left after its prompt (silently: the turn simply ends there, as ``length``). When it was clamped, a reasoning
    budget then leaves the answer at least a quarter of what is left (a budget asked within a larger
    ``max_tokens`` than the clamp allows would otherwise leave no room for it)."""
    asked = request.max_tokens if request.max_tokens > max_output_tokens else request.asked_max_tokens
    max_tokens = min(request.max_tokens, max_output_tokens, context_room)
    budget = request.reasoning_budget
    if budget is not None and max_tokens < request.max_tokens:
        budget = min(budget, max_tokens - max(1, max_tokens // 4))
    return replace(request, max_tokens=max_tokens, asked_max_tokens=asked, reasoning_budget=budget)


class FinishReason(str, enum.Enum):
    """Why a turn ended: one value per reason (runtime/scheduler/turn_end.py decides which). What each protocol
    reports for it is ``outcome`` (the API maps that to its own words)."""

    STOP = "stop"  # the model emitted an end-of-sequence token
    COMPLETE = "complete"  # the reply's output format (a JSON schema, a forced call) says it is whole
    STOP_SEQUENCE = "stop_sequence"  # one of the request's stop strings
    TURN_END = "turn_end"  # the chat format's next-speaker marker came out as text
    LENGTH = "length"  # max_tokens or the context limit
    TIME_LIMIT = "time_limit"  # generating for max_output_seconds
    FORMAT_CUT = "format_cut"  # a constrained reply ended (stop string, loop, dead end) before its value was whole
    CAPACITY = "capacity"  # the pool could not grow the sequence any further
    REPETITION = "repetition"  # a runaway loop: the last tokens repeat one short cycle (domain/repetition.py)
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def outcome(self) -> str:
        """What a client is told: "stop" (the reply ended as the model or its format meant), "stop_sequence",
        "length" (cut short: reported as truncation), "cancelled" or "error"."""
        return _OUTCOMES.get(self, "stop")


_OUTCOMES = {FinishReason.STOP_SEQUENCE: "stop_sequence", FinishReason.LENGTH: "length",
             FinishReason.TIME_LIMIT: "length", FinishReason.FORMAT_CUT: "length", FinishReason.CAPACITY: "length",
             FinishReason.CANCELLED: "cancelled", FinishReason.ERROR: "error"}


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one turn. ``reused + prefilled == prompt``."""

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    # Of the generated tokens, those the model reasoned with (a thinking model's; markers not counted).
    reasoning_tokens: int = 0
    # Where the reused tokens came from: the agent's own cache, another
    # agent's shared prefix, or the warm (disk) tier.
    reuse_source: str = "none"
    # Set when a usable cache existed but could not be used (e.g. a rotating
    # sliding-window cache that cannot be trimmed back to the divergence).
    reuse_note: str | None = None
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    duration_s: float | None = None
    # The hand-off between the pool and the batch (see Turn): admission to the first prefill
    # chunk, last token to the cache settled, and KV bytes copied on the way.
    handoff_in_s: float = 0.0
    handoff_out_s: float = 0.0
    copied_bytes: int = 0
    # How the prompt met the agent's cache (domain/forensics.py CacheOutcome) and, when the prompt
    # left the cached tokens before their end, the index of the first differing token.
    cache_outcome: str = "new_agent"
    diverged_at: int | None = None
    # What speculative decoding did in this turn (None: the turn did not speculate).
    speculation: SpeculationTally | None = None
    # A constrained reply that looped and was steered to its shortest valid end (grammar/loop_closing.py).
    loop_closed: LoopClosed | None = None
    # The weights that served the turn (name@digest; several resident models: the one it was routed to).
    model: str | None = None


@dataclass(frozen=True, slots=True)
class LoopClosed:
    """Where a constrained reply began to be steered closed and why: a loop was noticed in it (``kind``
    "loop"), or ``max_tokens`` was about to cut it unclosed ("token_limit")."""

    at_token: int  # answer tokens the reply held when the closing began
    why: str
    tokens_left: int = 0  # of max_tokens, left unspent when the reply closed (what the loop would have run on)
    kind: Literal["loop", "token_limit"] = "loop"

    def describe(self) -> str:
        if self.kind == "token_limit":
            return (f"the reply's JSON was closed after {self.at_token} tokens, before max_tokens cut it "
                    f"({self.why}); {self.tokens_left} of max_tokens left unspent")
        return (f"a loop in the reply's JSON was closed after {self.at_token} tokens ({self.why}); "
                f"{self.tokens_left} of max_tokens left unspent")


@dataclass(frozen=True, slots=True)
class QueuedEvent:
    request_id: str
    position: int


@dataclass(frozen=True, slots=True)
class PrefillEvent:
    """Prompt processing progress: ``done`` of ``total`` tokens to prefill."""

    request_id: str
    done: int
    total: int
    reused: int


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token and the text it made: answer text, reasoning, or a call's arguments (a thinking model's
    tokens go to one of them, domain/reasoning.py; markers to none)."""

    request_id: str
    token_id: int
    text: str  # answer text delta; may be empty while a multi-byte char or stop string is pending
    reasoning: str = ""  # reasoning text delta
    calls: tuple[CallText, ...] = ()  # arguments of calls written on their own channel (harmony)


@dataclass(frozen=True, slots=True)
class FinishEvent:
    request_id: str
    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None
    error: str | None = None
    error_type: str | None = None
    retry_after_s: int | None = None
    # Why the engine ended the turn when the model did not (a runaway loop cut short).
    note: str | None = None


EngineEvent = QueuedEvent | PrefillEvent | TokenEvent | FinishEvent
EventSink = Callable[[EngineEvent], None]
