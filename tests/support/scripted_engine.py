"""A deterministic fake engine with the real Engine's client interface.

API and workbench tests use it to script exactly what the "model" says
(tool calls, stop strings, long prefills, errors) without MLX. It keeps a
real BlockPool and per-agent token lists, so reuse numbers, tiers and the
pool map behave like the real engine's.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.platform.memory import MemoryReading
from engine.runtime.memory_pressure import MemoryWatch, Watermarks
from engine.domain.priority import DEFAULT_LEVELS, AgentClass
from engine.domain.block_layout import common_prefix_length
from engine.domain.forensics import TurnForensics, examine
from engine.domain.block_pool import BlockPool
from engine.domain.cache_spec import ModelCacheSpec, group_layers
from engine.errors import (
    AgentExistsError,
    AgentNotFoundError,
    EngineUnavailableError,
    InvalidRequestError,
    PromptTooLongError,
)
from engine.runtime.tiers.branching import Branch
from engine.models.loaded import LoadedModel, ModelIdentity
from engine.runtime.tiers.agents import Tier
from engine.domain.event_log import EventKind, EventLog
from engine.models.sampling_defaults import FALLBACK
from engine.settings import Settings
from engine.domain.requests import (
    AgentSource,
    EventSink,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PrefillEvent,
    QueuedEvent,
    TokenEvent,
    Usage,
    clamped,
)
from engine.runtime.engine_thread.snapshot import (
    AgentView,
    EngineSnapshot,
    ModelView,
    ThroughputView,
    TierView,
)

from engine.grammar.output_grammars import OutputGrammars

from engine.domain.reasoning import HarmonyFormat, ReasoningFormat
from engine.domain.reasoning_tracker import start_tracker
from engine.runtime.runner.routed_text import RoutedDelta, RoutedText

from .byte_tokenizer import EOS, ByteTokenizer

Script = Callable[[GenerationRequest], str]


def echo_script(request: GenerationRequest) -> str:
    return "Hello from the scripted model."


def scripted_loaded(context: int = 4096, block_tokens: int = 16, name: str = "scripted",
                    tokenizer: object | None = None) -> LoadedModel:
    """A model that is only a tokenizer (the byte tokenizer; a MarkerTokenizer for a thinking model)."""
    spec = ModelCacheSpec(4, 2, 8, "float32", block_tokens, group_layers([None] * 4))
    return LoadedModel(
        model_id=name,
        identity=ModelIdentity(name, "0" * 64),
        path=Path("/nonexistent/scripted"),
        architecture="scripted",
        model=None,
        tokenizer=tokenizer if tokenizer is not None else ByteTokenizer(),
        spec=spec,
        context_length=context,
    )


@dataclass
class FakeAgent:
    agent_id: str
    source: str
    display_name: str | None
    tokens: list[int] = field(default_factory=list)
    tier: Tier = Tier.EMPTY
    state: str = "idle"
    pinned: bool = False
    turns: int = 0
    prompt_total: int = 0
    reused_total: int = 0
    last_ttft_s: float | None = None
    last_tok_s: float | None = None
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    history: list[TurnForensics] = field(default_factory=list)
    retained_until: float = 0.0
    turn_ends: list[int] = field(default_factory=list)  # tokens cached at the end of each turn, as the engine's
    agent_class: str = "main"
    family: str | None = None
    priority: int | None = None
    paused: bool = False


class ScriptedEngine:
    """Emits ``script(request)`` one character per token after an optional prefill delay."""

    def __init__(
        self,
        script: Script = echo_script,
        *,
        loaded: LoadedModel | None = None,
        pool_blocks: int = 256,
        prefill_delay_s: float = 0.0,
        token_delay_s: float = 0.0,
        fail_with: str | None = None,
        seed_agents: tuple = (),
        max_output_tokens: int = Settings.model_fields["max_output_tokens"].default,
    ) -> None:
        self.loaded = loaded or scripted_loaded()
        self.max_output_tokens = max_output_tokens
        self.sampling_defaults = FALLBACK  # a scripted model has no generation_config.json
        # Structured outputs are compiled as the real engine compiles them (the script ignores the format).
        self.grammars = OutputGrammars(self.loaded.tokenizer, self.loaded.eos_token_ids)
        self.heartbeat = 0.0
        self.stall: float | None = None  # what the watchdog reports; tests set it
        # Memory watermarks over a fixed machine reading (16 GiB, 4 GiB in use): the admin endpoint moves them;
        # the scripted engine never refuses a request for memory.
        self.memory = MemoryWatch(Watermarks(12 * 2**30, 14 * 2**30),
                                  lambda: MemoryReading(16 * 2**30, 12 * 2**30, 2**30, 2**29, 0))
        self.memory.sample()
        self.script = script
        self.prefill_delay_s = prefill_delay_s
        self.token_delay_s = token_delay_s
        self.fail_with = fail_with
        self.events = EventLog()
        self.pool = BlockPool(pool_blocks, self.loaded.spec.block_bytes, len(self.loaded.spec.groups))
        self.agents: dict[str, FakeAgent] = {
            seed.agent_id: FakeAgent(seed.agent_id, seed.source, seed.display_name, pinned=seed.pinned) for seed in seed_agents
        }
        self.requests: list[GenerationRequest] = []
        self.cancelled: set[str] = set()
        self.watchers: dict[str, list[EventSink]] = {}
        self._lock = threading.RLock()
        self._running = True
        self.generated_total = 0
        # Engine ops (evict, fork, rewind...) apply to ``engine.ops``: the scripted engine implements them itself.
        self.ops = self

    # -- Engine's client interface -----------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    def start(self) -> None:
        self._running = True

    def stop(self, grace_s: float = 0.0) -> None:
        self._running = False

    def validate(self, request: GenerationRequest) -> GenerationRequest:
        n = len(request.prompt_tokens)
        if n + 1 > self.context_length:
            raise PromptTooLongError(n, self.context_length)
        return clamped(request, self.max_output_tokens, self.context_length - n)

    def submit(self, request: GenerationRequest, sink: EventSink) -> str:
        if not self._running:
            raise EngineUnavailableError("engine is not running")
        request = self.validate(request)
        self.requests.append(request)
        fan_out = self._fan_out(request.agent_id, sink)
        threading.Thread(target=self._serve, args=(request, fan_out), daemon=True).start()
        return request.request_id

    def watch(self, agent_id: str, sink: EventSink) -> None:
        self.watchers.setdefault(agent_id, []).append(sink)

    def unwatch(self, agent_id: str, sink: EventSink) -> None:
        if sink in self.watchers.get(agent_id, []):
            self.watchers[agent_id].remove(sink)

    def _fan_out(self, agent_id: str, sink: EventSink) -> EventSink:
        def deliver(event) -> None:
            sink(event)
            for watcher in list(self.watchers.get(agent_id, ())):
                watcher(event)

        return deliver

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self.cancelled.add(request_id)

    def call(self, fn: Callable[["ScriptedEngine"], object]) -> Future:
        future: Future = Future()
        try:
            with self._lock:
                future.set_result(fn(self))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            return self._build_snapshot()

    fresh_snapshot = snapshot

    # -- admin operations, same names as Engine's -------------------------------------------
    def evict_agent(self, agent_id: str, tier: Tier) -> None:
        agent = self._agent(agent_id)
        self.pool.release_owner(agent_id)
        agent.tier = tier
        self.events.emit(EventKind.EVICT, f"{agent_id}: hot -> {tier.value} (requested)", agent_id)

    def evict_idle(self, tier: Tier = Tier.WARM) -> int:
        idle = [a for a in self.agents.values() if a.tier is Tier.HOT and a.state == "idle" and not a.pinned]
        for agent in idle:
            self.evict_agent(agent.agent_id, tier)
        return len(idle)

    def pin_agent(self, agent_id: str, pinned: bool) -> None:
        self._agent(agent_id).pinned = pinned

    def set_agent_priority(self, agent_id: str, level: int | None) -> None:
        self._agent(agent_id).priority = level

    def pause_agent(self, agent_id: str, paused: bool) -> None:
        self._agent(agent_id).paused = paused

    def hold_agent(self, agent_id: str, seconds: float) -> None:
        agent = self.agents.get(agent_id)
        if agent is not None:
            agent.retained_until = max(agent.retained_until, time.monotonic() + seconds)

    def delete_agent(self, agent_id: str) -> None:
        self._agent(agent_id)
        self.pool.release_owner(agent_id)
        del self.agents[agent_id]

    def fork_agent(self, source_id: str, new_id: str, turn: int | None = None,
                   prompt: tuple[int, ...] | None = None, display_name: str | None = None,
                   source_kind: AgentSource | None = None) -> Branch:
        source = self._agent(source_id)
        if new_id in self.agents:
            raise AgentExistsError(new_id)
        n = self._cut(source, turn, prompt)
        kind = source_kind.value if source_kind is not None else source.source
        self.agents[new_id] = FakeAgent(new_id, kind, display_name, tokens=source.tokens[:n],
                                        tier=Tier.HOT if n else Tier.EMPTY,
                                        turn_ends=[end for end in source.turn_ends if end <= n])
        return Branch(new_id, n, 0, 0, n)

    def rewind_agent(self, agent_id: str, turn: int | None = None, prompt: tuple[int, ...] | None = None) -> Branch:
        agent = self._agent(agent_id)
        n = self._cut(agent, turn, prompt)
        agent.tokens = agent.tokens[:n]
        agent.turn_ends = [end for end in agent.turn_ends if end <= n]
        return Branch(agent_id, n, 0, 0, n)

    def _cut(self, agent: FakeAgent, turn: int | None, prompt: tuple[int, ...] | None) -> int:
        if prompt is not None:
            return min(common_prefix_length(agent.tokens, prompt), len(agent.tokens))
        if turn is not None and turn > len(agent.turn_ends):
            raise InvalidRequestError(f"turn {turn} is out of range: {agent.agent_id} has "
                                      f"{len(agent.turn_ends)} turns", field="turn")
        if turn is None:
            return len(agent.tokens)
        return agent.turn_ends[turn - 1] if turn > 0 else 0

    def write_agent(self, agent_id: str) -> None:
        self._agent(agent_id)
        raise EngineUnavailableError("the scripted engine keeps no cache files")

    def check_import(self, agent_id: str, replace: bool) -> None:
        if agent_id in self.agents and not replace:
            raise AgentExistsError(agent_id)

    def adopt_agent(self, path: object) -> str:
        raise EngineUnavailableError("the scripted engine keeps no cache files")

    def _agent(self, agent_id: str) -> FakeAgent:
        agent = self.agents.get(agent_id)
        if agent is None:
            raise AgentNotFoundError(agent_id)
        return agent

    # -- serving ------------------------------------------------------------------------------
    def _serve(self, request: GenerationRequest, sink: EventSink) -> None:
        start = time.monotonic()
        with self._lock:
            agent = self._admit(request)
            tier_before = agent.tier.value
            reused = self._reuse(agent, request)
            agent.history.append(examine(
                request_id=request.request_id, prompt=request.prompt_tokens, cached=agent.tokens,
                cached_tokens=len(agent.tokens), tier_before=tier_before, model_changed=False, reused=reused,
                source="self" if reused else "none", note=None, side=False, head_tokens=request.head_tokens,
                block_tokens=self.loaded.spec.block_tokens, decode=self.loaded.tokenizer.decode))
        sink(QueuedEvent(request.request_id, 1))
        sink(PrefillEvent(request.request_id, 0, len(request.prompt_tokens) - reused, reused))
        time.sleep(self.prefill_delay_s)
        if self.fail_with:
            return self._finish(request, sink, agent, reused, 0, start, FinishReason.ERROR, error=self.fail_with)
        if self.loaded.reasoning is not None:  # a thinking model: its tokens routed as the engine routes them
            tokens, reason, stop_hit, reasoning = self._emit_routed(request, sink, self.script(request))
            with self._lock:
                agent.tokens = list(request.prompt_tokens) + tokens
            return self._finish(request, sink, agent, reused, len(tokens), start, reason, stop_sequence=stop_hit,
                                reasoning_tokens=reasoning)
        text, stop_hit = self._cut_at_stop(self.script(request), request.stop_strings)
        generated, reason = self._emit(request, sink, text)
        if reason is None:
            reason = FinishReason.STOP_SEQUENCE if stop_hit else FinishReason.STOP
        with self._lock:
            agent.tokens = list(request.prompt_tokens) + list(text[:generated].encode())
        self._finish(request, sink, agent, reused, generated, start, reason, stop_sequence=stop_hit)

    def _admit(self, request: GenerationRequest) -> FakeAgent:
        agent = self.agents.get(request.agent_id)
        if agent is None:
            agent = FakeAgent(request.agent_id, request.source.value, request.display_name)
            self.agents[request.agent_id] = agent
        agent.state, agent.last_used = "decoding", time.time()
        agent.agent_class, agent.family = request.agent_class.value, request.lineage.family
        if request.retain_s > 0:
            agent.retained_until = max(agent.retained_until, time.monotonic() + request.retain_s)
        return agent

    def _reuse(self, agent: FakeAgent, request: GenerationRequest) -> int:
        if agent.tier is not Tier.HOT:
            return 0
        return min(common_prefix_length(agent.tokens, request.prompt_tokens), len(request.prompt_tokens) - 1)

    @staticmethod
    def _cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if not hits:
            return text, None
        at, stop = min(hits)
        return text[:at], stop

    def _emit(self, request: GenerationRequest, sink: EventSink, text: str) -> tuple[int, FinishReason | None]:
        for i, char in enumerate(text):
            if request.request_id in self.cancelled:
                return i, FinishReason.CANCELLED
            if i >= request.max_tokens:
                return i, FinishReason.LENGTH
            sink(TokenEvent(request.request_id, ord(char) % 256, char))
            time.sleep(self.token_delay_s)
        return len(text), None

    def _emit_routed(self, request: GenerationRequest, sink: EventSink,
                     script: str) -> tuple[list[int], FinishReason, str | None, int]:
        """The script as the model's tokens through the engine's own reasoning tracker and routed text: markers
        hidden, stop strings looked for in the answer only, a budget forcing the end marker (the script's reasoning
        is then skipped to its own end marker, as a model would go on to answer)."""
        tokenizer = self.loaded.tokenizer
        tracker = start_tracker(self.loaded.reasoning, request.prompt_tokens, tokenizer.decode,
                                request.reasoning_budget)
        text = RoutedText(lambda: tokenizer.detokenizer, request.stop_strings, request.turn_end_strings)
        queue, out = list(tokenizer.encode(script, add_special_tokens=False)), []
        while len(out) < request.max_tokens:
            if request.request_id in self.cancelled:
                return out, FinishReason.CANCELLED, None, tracker.reasoning_tokens
            rule = tracker.rule()
            if rule is not None and rule.force is not None:
                if queue and queue[0] != rule.force:
                    queue = _after_reasoning(queue, self.loaded.reasoning)
                token = rule.force
                if queue and queue[0] == token:
                    queue.pop(0)
            elif queue:
                token = queue.pop(0)
            else:
                token = EOS
            out.append(token)
            if token in tokenizer.eos_token_ids:
                delta = text.push(tracker.flush())
                _merge(delta, text.finish())
                self._send(sink, request, token, delta)
                return out, FinishReason.STOP, None, tracker.reasoning_tokens
            delta = text.push(tracker.feed(token))
            if delta.stop_sequence is not None or delta.ends_turn:
                self._send(sink, request, token, delta)
                return out, (FinishReason.STOP_SEQUENCE if delta.stop_sequence else FinishReason.STOP), \
                    delta.stop_sequence, tracker.reasoning_tokens
            self._send(sink, request, token, delta)
            time.sleep(self.token_delay_s)
        delta = text.push(tracker.flush())
        _merge(delta, text.finish())
        self._send(sink, request, out[-1], delta)
        return out, FinishReason.LENGTH, None, tracker.reasoning_tokens

    def _send(self, sink: EventSink, request: GenerationRequest, token: int, delta) -> None:
        if not delta.empty or token not in self.loaded.tokenizer.eos_token_ids:
            sink(TokenEvent(request.request_id, token, delta.text, delta.reasoning, tuple(delta.calls)))

    def _finish(self, request, sink, agent, reused, generated, start, reason, error=None, stop_sequence=None,
                reasoning_tokens: int = 0) -> None:
        with self._lock:
            self._settle(agent, request, reused, generated)
        usage = Usage(len(request.prompt_tokens), reused, len(request.prompt_tokens) - reused, generated,
                      reasoning_tokens, "self" if reused else "none", None, 0.001, 100.0, time.monotonic() - start)
        sink(FinishEvent(request.request_id, reason, usage, stop_sequence=stop_sequence, error=error,
                         error_type="api_error" if error else None))

    def _settle(self, agent: FakeAgent, request: GenerationRequest, reused: int, generated: int) -> None:
        agent.state, agent.turns = "idle", agent.turns + 1
        agent.turn_ends.append(len(agent.tokens))
        agent.prompt_total += len(request.prompt_tokens)
        agent.reused_total += reused
        agent.last_ttft_s, agent.last_tok_s = 0.001, 100.0
        self.generated_total += generated
        self.pool.release_owner(agent.agent_id)
        blocks = self.loaded.spec.total_blocks_for_tokens(len(agent.tokens))
        if self.pool.allocate(agent.agent_id, {0: min(blocks, self.pool.free_blocks)}) is not None:
            agent.tier = Tier.HOT
        self.events.emit(EventKind.FINISH, f"{agent.agent_id}: {generated} tokens", agent.agent_id)

    # -- snapshot -----------------------------------------------------------------------------
    def _build_snapshot(self) -> EngineSnapshot:
        spec = self.loaded.spec
        agents = tuple(self._view(a) for a in self.agents.values())
        tiers = TierView(
            hot_agents=sum(a.tier is Tier.HOT for a in self.agents.values()),
            warm_agents=sum(a.tier is Tier.WARM for a in self.agents.values()),
            cold_agents=sum(a.tier is Tier.COLD for a in self.agents.values()),
            hot_bytes=self.pool.used_bytes,
        )
        model = ModelView(self.loaded.model_id, self.loaded.identity.key, None, "scripted", self.context_length, spec.describe(),
                          self.sampling_defaults.describe(), "off", f"no: {self.loaded.vision_note}",
                          spec.hot_kv_summary())
        throughput = ThroughputView(generated_total=self.generated_total, requests_total=len(self.requests))
        return EngineSnapshot("ready" if self._running else "stopped", model, self.pool.snapshot(), agents, throughput, tiers,
                              memory=self.memory.describe())

    def set_memory_watermarks(self, watermarks: Watermarks) -> None:
        self.memory.set_watermarks(watermarks)
        self.memory.sample()

    def stalled_for(self) -> float | None:
        return self.stall

    def publish_now(self) -> EngineSnapshot:
        return self.snapshot()

    def _view(self, a: FakeAgent) -> AgentView:
        blocks = self.pool.owned_blocks(a.agent_id)
        return AgentView(
            a.agent_id, a.display_name, a.source, a.state, a.tier.value, a.pinned, self.loaded.identity.key,
            len(a.tokens), blocks, blocks * self.pool.block_bytes, a.turns,
            a.reused_total / a.prompt_total if a.prompt_total else 0.0, a.last_ttft_s, a.last_tok_s, 0, 0,
            a.last_used, a.created_at, history=tuple(a.history), turn_ends=tuple(a.turn_ends),
            retained_s=max(0.0, a.retained_until - time.monotonic()),
            agent_class=a.agent_class, family=a.family,
            priority=a.priority if a.priority is not None else DEFAULT_LEVELS[AgentClass(a.agent_class)],
            priority_set=a.priority is not None, paused=a.paused,
        )


def _after_reasoning(queue: list[int], fmt: ReasoningFormat) -> list[int]:
    """The script past its reasoning: from its own end marker on (the engine forces one in its place)."""
    end = (fmt.end,) if isinstance(fmt, HarmonyFormat) else fmt.end
    for at in range(len(queue) - len(end) + 1):
        if tuple(queue[at:at + len(end)]) == tuple(end):
            return queue[at:]
    return []


def _merge(delta: RoutedDelta, more: RoutedDelta) -> None:
    delta.text += more.text
    delta.reasoning += more.reasoning
    delta.calls.extend(more.calls)
