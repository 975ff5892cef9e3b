"""What the HTTP layer (and the workbench) hold on to: the running engine and its settings.

The engine behind the service can be replaced by a model swap; every request
picks up the current one when it starts and keeps it until it finishes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from engine.domain.event_log import EventKind, EventLog
from engine.domain.requests import GenerationRequest
from engine.errors import EngineUnavailableError
from engine.models.loaded import LoadedModel
from engine.models.registry import ModelRegistry
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.engine_ops import HoldAgent
from engine.runtime.engine_thread.snapshot import EngineSnapshot
from engine.settings import Settings
from engine.swap import EngineBuilder, ModelSwapper

if TYPE_CHECKING:
    from engine.resident_models import ResidentModels
    from engine.store.agents_on_disk import ModelKey

from engine.formats.reasoning_recall import ReasoningRecall
from engine.formats.rendered_heads import RenderedHeads
from engine.formats.rendering import PromptRenderer

from .agent_lanes import AgentLanes
from .async_turn import AsyncTurn

T = TypeVar("T")
GATE_POLL_S = 0.05  # how often a request waiting out a swap looks again


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model a request was routed to (engine/models/model_slots.py): its engine, under which alias, why."""

    engine: Engine
    alias: str
    why: str = "default"

    @property
    def loaded(self) -> LoadedModel:
        return self.engine.loaded


class EngineService:
    def __init__(self, settings: Settings, engine: Engine | None, events: EventLog | None = None) -> None:
        self.settings = settings
        self.events = events or (engine.events if engine is not None else EventLog())
        self._engine: Engine | None = None
        self.started_at = time.time()
        self.status_detail: str | None = None
        self.registry = ModelRegistry(settings.models_dir)
        self.swapper: ModelSwapper | None = None
        self.last_activity = time.monotonic()
        self._capped_agents: set[str] = set()
        # Stall episodes seen (the watchdog): each distinct frozen heartbeat counts once.
        self.stalls_total = 0
        self._stall_beat: float | None = None
        # Closed while a model swap (or an idle unload) runs: new requests wait.
        self._gate = threading.Event()
        self._gate.set()
        # Recent replies' reasoning, for clients that send a reply back without it (reasoning_recall.py).
        self.reasoning_recall = ReasoningRecall()
        # Sibling agents for concurrent requests no client named (agent_lanes.py).
        self.lanes = AgentLanes(settings.max_batch_size)
        # Each served model's prompt renderer and its rendered heads, by its weights' identity: a swap brings
        # a new tokenizer, and extra models have their own.
        self._rendering: dict[str, tuple[LoadedModel, PromptRenderer, RenderedHeads]] = {}
        # The models beside the default one (--extra-model; engine/resident_models.py), None without any.
        self.models: "ResidentModels | None" = None
        if engine is not None:
            self.attach(engine)

    # -- the current engine ------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        if self._engine is None or not self._engine.is_running:
            raise EngineUnavailableError(self.status_detail or "no model is loaded yet", retry_after_s=5)
        return self._engine

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        self.status_detail = None
        loaded = engine.loaded
        self.registry.set_loaded(self._current_ref(), loaded.model_id, loaded.architecture, loaded.spec.describe(), loaded.path)

    def detach(self) -> None:
        """Forget the engine (a swap released it); cached renderers go with it."""
        self._engine = None
        self._rendering = {key: value for key, value in self._rendering.items()
                           if self.models is not None and self.models.engine_with_key(key) is not None}

    def detachable_engine(self) -> Engine | None:
        return self._engine

    def _current_ref(self) -> str:
        return self.swapper.current_ref if self.swapper is not None else self.settings.model

    @property
    def is_ready(self) -> bool:
        return self._engine is not None and self._engine.is_running

    @property
    def loaded(self) -> LoadedModel:
        return self.engine.loaded

    def renderer(self, engine: Engine | None = None) -> PromptRenderer:
        """A served model's prompt renderer (one per model; default: the default model's)."""
        return self._rendering_for(engine or self.engine)[1]

    def rendered_heads(self, engine: Engine | None = None) -> RenderedHeads:
        """Recent conversations' rendered system prompts and tools, for a served model."""
        return self._rendering_for(engine or self.engine)[2]

    def _rendering_for(self, engine: Engine) -> tuple[LoadedModel, PromptRenderer, RenderedHeads]:
        loaded = engine.loaded
        key = loaded.identity.key
        cached = self._rendering.get(key)
        if cached is None or cached[0].tokenizer is not loaded.tokenizer:
            cached = self._rendering[key] = (loaded, PromptRenderer(loaded.tokenizer), RenderedHeads())
        return cached

    # -- which model serves a request ------------------------------------------------------------------
    async def served(self, name: str | None, auxiliary: bool = False) -> ServedModel:
        """The model a request naming ``name`` goes to, ready to take its turn (loaded first when it must be).

        Without extra models every request goes to the loaded model, as ever (a registry model's name may swap
        to it, with allow_model_swap_by_request)."""
        models = self.models
        if models is not None:
            slot, why = models.route(name, auxiliary)
            if not slot.is_default:
                return ServedModel(await self.in_thread(models.engine_for, slot.alias), slot.alias, why)
        elif name and self.settings.allow_model_swap_by_request:
            await self.ensure_model(name)
            why = "default"
        else:
            why = "default"
        await self.wait_ready()
        return ServedModel(self.engine, models.routes.default.alias if models is not None else self.settings.model,
                           why)

    def hold_tool_loop(self, engine: Engine, agent_id: str) -> None:
        """The agent's reply was a tool call: keep its cache hot ``tool_loop_hold_s`` while the client runs the
        tool (queued on the engine thread; nothing waits for it)."""
        seconds = self.settings.tool_loop_hold_s
        if seconds > 0:
            engine.call(HoldAgent(agent_id, seconds))

    def engine_for(self, request: GenerationRequest) -> Engine:
        """The engine a prepared request was rendered for (its ``model_id``); the default one otherwise."""
        if self.models is not None and request.model_id:
            engine = self.models.engine_with_key(request.model_id)
            if engine is not None:
                return engine
        return self.engine

    def import_target(self, made_by: ModelKey, model: str | None = None) -> tuple[str, Engine]:
        """(alias, engine) an agent file made by ``made_by`` is imported into: the serving model ``model``
        names, else the serving model whose weights made it, else the default model (whose check then
        refuses a foreign file, naming both models)."""
        served = self.served_engines()
        if model is not None:
            for alias, engine in served:
                if alias == model:
                    return alias, engine
            raise EngineUnavailableError(f"no model {model!r} is serving now; GET /v1/models lists the models "
                                         "and POST /v1/admin/models/{alias}/load loads one", retry_after_s=5)
        for alias, engine in served:
            identity = engine.loaded.identity
            if identity.digest == made_by.digest and identity.name == made_by.name:
                return alias, engine
        return (served[0][0] if served else self.settings.model), self.engine

    def snapshot(self) -> EngineSnapshot | None:
        return self._engine.snapshot() if self._engine is not None else None

    def serve_extra_models(self, engine: Engine) -> None:
        """The models of --extra-model beside ``engine`` (the default one); the pinned ones load behind it,
        so the default model serves from the start."""
        from engine.bootstrap import resident_models

        self.models = resident_models(self.settings, self.detachable_engine, self.events,
                                      getattr(engine, "device_turns", None))
        if self.models is not None:
            threading.Thread(target=self.models.load_pinned, name="semantic-pinned-models", daemon=True).start()

    # -- model swaps --------------------------------------------------------------------------
    def enable_swaps(self, build_engine: EngineBuilder) -> ModelSwapper:
        self.swapper = ModelSwapper(self, build_engine, self.settings.model)
        if self.settings.idle_unload_s:
            threading.Thread(target=self._watch_idle, name="semantic-idle-unload", daemon=True).start()
        return self.swapper

    def _watch_idle(self) -> None:
        """Unload the model after idle_unload_s without requests; wait_ready reloads it."""
        limit = float(self.settings.idle_unload_s or 0)
        while self.swapper is not None:
            time.sleep(min(5.0, limit / 4))
            snapshot = self.snapshot()
            busy = snapshot is not None and snapshot.throughput.active_requests > 0
            idle_for = time.monotonic() - self.last_activity
            if self.is_ready and not busy and idle_for > limit:
                self.swapper.unload(self.settings.swap_grace_s, f"idle for {idle_for:.0f} s")

    def close_gate(self, reason: str) -> None:
        self._gate.clear()
        self.status_detail = reason

    def open_gate(self) -> None:
        self._gate.set()

    def note(self, kind: EventKind, message: str, level: int = logging.INFO) -> None:
        self.events.emit(kind, message, level=level)

    def stalled_for(self) -> float | None:
        """Seconds the engine has made no progress while work waits (None: it is fine), counting episodes."""
        engine = self._engine
        stalled = engine.stalled_for() if engine is not None and engine.is_running else None
        if stalled is not None and engine is not None and engine.heartbeat != self._stall_beat:
            self._stall_beat = engine.heartbeat
            self.stalls_total += 1
            self.events.emit(EventKind.ERROR, f"engine stalled: no step for {stalled:.0f} s while work waits",
                             level=logging.ERROR)
        return stalled

    def note_output_cap(self, request: GenerationRequest) -> None:
        """Log the output cap once per agent (every turn of a Claude Code session asks for 32,000)."""
        if request.agent_id in self._capped_agents:
            return
        self._capped_agents.add(request.agent_id)
        self.events.emit(
            EventKind.INFO,
            f"{request.agent_id}: max_tokens {request.asked_max_tokens} clamped to {request.max_tokens} "
            "(max_output_tokens; said once per agent)", request.agent_id,
        )

    async def ensure_model(self, name: str) -> None:
        """Swap to the model a request names, when it names another registry model."""
        entry = await self.in_thread(self.registry.resolve_request_model, name)
        loaded = self.registry.loaded
        if self.swapper is None or entry is None or (loaded is not None and entry.location == loaded.location):
            return
        if not self.swapper.status.running:
            self.swapper.request(entry.location, self.settings.swap_grace_s)

    async def wait_ready(self) -> None:
        """Wait out a running swap (up to swap_wait_s), reload after an idle unload; else 503."""
        self.last_activity = time.monotonic()
        swapper = self.swapper
        if swapper is not None:
            swapper.want_model()  # after an idle unload, or once the one in progress ends
        if not self._gate.is_set() and not await self._gate_opened(self.settings.swap_wait_s):
            raise EngineUnavailableError(f"{self.status_detail or 'model swap'} is still running", retry_after_s=10)
        self.engine  # raises 503 when nothing is loaded

    async def _gate_opened(self, timeout_s: float) -> bool:
        """Wait for a swap to end without holding a thread (many requests may be waiting)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._gate.is_set():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(GATE_POLL_S)
        return True

    # -- work --------------------------------------------------------------------------------
    def start_turn(self, request: GenerationRequest) -> AsyncTurn:
        engine = self.engine_for(request)
        try:
            return AsyncTurn(engine, request, on_finish=lambda: self.lanes.release(request.request_id))
        except BaseException:
            self.lanes.release(request.request_id)
            raise
        finally:
            if self.models is not None:
                self.models.release_lease(request.model_id or "")

    async def call(self, fn: Callable[[Engine], T], timeout_s: float = 30.0) -> T:
        """Run ``fn(engine)`` on the default model's engine thread and await its result."""
        return await self.call_on(self.engine, fn, timeout_s)

    async def call_on(self, engine: Engine, fn: Callable[[Engine], T], timeout_s: float = 30.0) -> T:
        """Run ``fn(engine)`` on that engine's thread (one of the resident models') and await its result."""
        future = engine.call(fn)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

    def served_engines(self) -> list[tuple[str, Engine]]:
        """(alias, engine) of every model serving now, the default first (one entry without extra models)."""
        if self.models is not None:
            return [(slot.alias, engine) for slot, engine in self.models.engines()]
        return [(self.settings.model, self._engine)] if self._engine is not None else []

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU work that must not block the event loop (tokenizing a long prompt)."""
        return await asyncio.to_thread(fn, *args)
