"""Several models resident under one memory budget: loaded on first use, unloaded least recently used.

The default model (``--model``) is the service's engine, as in a one-model
server (a swap replaces it, engine/swap.py). The extra models
(``--extra-model``) each get an engine of their own here: their own pool, agents and
warm tier (caches on disk are kept per model already), sharing the
device with the default model's engine by turns (device_turns.py).

Every resident model's weights and KV pool budget count against
``models_budget_mb``. A model that is asked for and does not fit first makes
room: resident extra models that are not pinned and have no turn running or
about to run are unloaded, least recently used first (their hot agents go to
the warm tier, as at shutdown, and come back when the model does). What
still does not fit is refused with what is resident and what each holds.

All of it runs off the event loop: ``engine_for`` blocks while a model loads
(the API calls it in a worker thread); requests for other models go on.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from mlx.utils import tree_flatten

from engine.domain.event_log import EventKind, EventLog
from engine.errors import EngineUnavailableError, ModelsBudgetError, SemanticError
from engine.domain.model_slots import ModelRoutes, ModelSlot
from engine.runtime.engine_thread.engine import Engine
from engine.swap import release_memory

log = logging.getLogger("semantic.models")

# A request routed to a model holds it this long before its turn is queued (rendering, tokenizing): an
# unload in between would fail it. Once queued, the engine's count of turns in flight holds it.
LEASE_S = 30.0
IDLE_POLL_S = 5.0

EngineBuild = Callable[[ModelSlot], Engine]


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    RESIDENT = "resident"
    UNLOADING = "unloading"
    FAILED = "failed"


@dataclass(slots=True)
class Resident:
    """One configured model and what is known of it now."""

    slot: ModelSlot
    state: ModelState = ModelState.UNLOADED
    engine: Engine | None = None
    weights_bytes: int = 0
    pool_bytes: int = 0
    last_used: float = 0.0  # monotonic
    leased_until: float = 0.0
    requests: int = 0
    loads: int = 0
    unloads: int = 0
    error: str | None = None
    loaded_event: threading.Event = field(default_factory=threading.Event)

    reserved_bytes: int = 0  # while it loads: what it is expected to hold (weights on disk, its pool's budget)

    @property
    def held_bytes(self) -> int:
        if self.state is ModelState.LOADING:
            return self.reserved_bytes
        return self.weights_bytes + self.pool_bytes if self.state is ModelState.RESIDENT else 0


def weights_nbytes(engine: Engine) -> int:
    """Bytes of the model's weights (its parameters; a draft model beside it included)."""
    loaded = engine.loaded
    total = sum(int(v.nbytes) for _, v in tree_flatten(loaded.model.parameters())) if loaded.model is not None else 0
    draft = getattr(loaded, "draft", None)
    if draft is not None and getattr(draft, "model", None) is not None:
        total += sum(int(v.nbytes) for _, v in tree_flatten(draft.model.parameters()))
    return total


class ResidentModels:
    """The extra models' engines, the budget over all of them, and which one a request goes to."""

    def __init__(self, routes: ModelRoutes, budget_bytes: int, build: EngineBuild,
                 default_engine: Callable[[], Engine | None], events: EventLog, grace_s: float = 10.0,
                 estimate_bytes: Callable[[ModelSlot], int] = lambda slot: 0) -> None:
        self.routes = routes
        self.budget_bytes = budget_bytes
        self._build = build
        self._default_engine = default_engine
        self._events = events
        self._grace_s = grace_s
        self._estimate = estimate_bytes
        self._lock = threading.Lock()
        self._residents = {slot.alias: Resident(slot) for slot in routes.slots if not slot.is_default}
        self._default_weights: tuple[int, int] | None = None  # (id of the engine, its weights' bytes)
        self._stopped = False
        self._default_requests = 0
        if any(r.slot.idle_unload_s for r in self._residents.values()):
            threading.Thread(target=self._watch_idle, name="semantic-model-idle", daemon=True).start()

    # -- which model ------------------------------------------------------------------------------
    def route(self, name: str | None, auxiliary: bool = False) -> tuple[ModelSlot, str]:
        default = self._default_engine()
        if default is not None:  # (a swap may have changed it)
            self.routes.model_ids[self.routes.default.alias] = default.loaded.model_id
        slot, why = self.routes.route(name, auxiliary)
        if slot.is_default:
            self._default_requests += 1  # (the extra models count theirs when their engine is handed out)
        return slot, why

    def engine_for(self, alias: str, request: bool = True) -> Engine:
        """The running engine of an extra model, loaded (room made first) when it is not; blocks while it loads.
        ``request``: a request was routed to it (counted, and it holds the model until its turn is queued);
        False for a load asked for itself (at start, from the admin API or the workbench).

        Raises ModelsBudgetError when it cannot fit, and what its load raised when it fails."""
        resident = self._residents[alias]
        while True:
            with self._lock:
                if resident.state is ModelState.RESIDENT and resident.engine is not None and resident.engine.is_running:
                    self._touch(resident, request)
                    return resident.engine
                if resident.state is ModelState.LOADING or resident.state is ModelState.UNLOADING:
                    wait_for = resident.loaded_event
                else:
                    wait_for = None
                    # Marked loading before room is made (which lets go of the lock while a model stops), so
                    # a second request for it waits for this load instead of starting another.
                    resident.state, resident.error = ModelState.LOADING, None
                    resident.loaded_event.clear()
                    try:
                        self._make_room(resident)
                    except ModelsBudgetError:
                        resident.state = ModelState.UNLOADED
                        resident.loaded_event.set()
                        raise
            if wait_for is not None:
                wait_for.wait()
                if resident.state is ModelState.FAILED:
                    raise EngineUnavailableError(f"model {alias} failed to load: {resident.error}", retry_after_s=30)
                continue
            return self._load(resident, request)

    def engine_with_key(self, key: str) -> Engine | None:
        """The running engine whose weights' identity is ``key`` (a request names it), of any model here."""
        default = self._default_engine()
        if default is not None and default.loaded.identity.key == key:
            return default
        for resident in list(self._residents.values()):
            engine = resident.engine
            if engine is not None and engine.loaded.identity.key == key:
                return engine
        return None

    def release_lease(self, key: str) -> None:
        """A routed request's turn is queued (or it failed first): the engine's own count holds it now."""
        for resident in self._residents.values():
            if resident.engine is not None and resident.engine.loaded.identity.key == key:
                resident.leased_until = 0.0

    def engines(self) -> list[tuple[ModelSlot, Engine]]:
        """Every running engine with its slot, the default first."""
        out = []
        default = self._default_engine()
        if default is not None:
            out.append((self.routes.default, default))
        out += [(r.slot, r.engine) for r in self._residents.values()
                if r.engine is not None and r.state is ModelState.RESIDENT]
        return out

    # -- loading and unloading --------------------------------------------------------------------
    def load_pinned(self) -> None:
        """Bring up the pinned extra models (at start, after the default model); a failure is logged, not fatal."""
        for resident in self._residents.values():
            if resident.slot.pinned:
                try:
                    self.engine_for(resident.slot.alias, request=False)
                except SemanticError as exc:
                    self._note(EventKind.ERROR, f"pinned model {resident.slot.alias} did not load: {exc}",
                               logging.ERROR)

    def _load(self, resident: Resident, request: bool) -> Engine:
        slot = resident.slot
        self._note(EventKind.LOAD, f"loading model {slot.alias} ({slot.source})")
        start = time.monotonic()
        try:
            engine = self._build(slot)
        except BaseException as exc:
            log.warning("model %s did not load", slot.alias, exc_info=True)
            self._note(EventKind.ERROR, f"model {slot.alias} did not load: {exc}", logging.ERROR)
            with self._lock:
                resident.state, resident.error = ModelState.FAILED, str(exc)
                resident.weights_bytes = resident.pool_bytes = 0
                resident.loaded_event.set()
            release_memory()
            raise
        with self._lock:
            resident.engine = engine
            resident.weights_bytes = self._own_weights(engine)
            resident.pool_bytes = engine.pool.total_bytes
            resident.state = ModelState.RESIDENT
            resident.loads += 1
            self.routes.model_ids[slot.alias] = engine.loaded.model_id  # a request may name it so from now on
            self._touch(resident, request)
            resident.loaded_event.set()
        self._note(EventKind.LOAD, f"model {slot.alias} resident in {time.monotonic() - start:.1f} s: weights "
                                   f"{_mib(resident.weights_bytes)}, KV pool {_mib(resident.pool_bytes)}; "
                                   f"{self._summary()}")
        return engine

    def _own_weights(self, engine: Engine) -> int:
        """Its weights' bytes, or 0 when they are the default model's draft (--draft-model ALIAS): those are
        counted once, in the default model's row."""
        return 0 if self._is_default_draft(engine) else weights_nbytes(engine)

    def _is_default_draft(self, engine: Engine | None) -> bool:
        """Whether ``engine`` serves with the default model's draft's weights (--draft-model ALIAS)."""
        default = self._default_engine()
        draft = getattr(default.loaded, "draft", None) if default is not None else None
        return draft is not None and engine is not None and engine is not default and draft.model is engine.loaded.model

    def set_pinned(self, alias: str, pinned: bool) -> None:
        """Pin an extra model (never unloaded to make room, nor when idle) or unpin it, from now on; it is not
        loaded here (a pinned model that is not resident loads on first use, or with load)."""
        with self._lock:
            resident = self._residents[alias]
            resident.slot = replace(resident.slot, pinned=pinned)
        self._note(EventKind.INFO, f"model {alias} {'pinned' if pinned else 'unpinned'}")

    def unload(self, alias: str, reason: str) -> bool:
        """Unload one extra model now (its agents to the warm tier); False when it may not go now."""
        resident = self._residents[alias]
        with self._lock:
            if resident.state is not ModelState.RESIDENT or self._busy(resident):
                return False
            resident.state = ModelState.UNLOADING
            resident.loaded_event.clear()
        self._stop(resident, reason)
        return True

    def _make_room(self, wanted: Resident) -> None:
        """Under the lock: unload what may go, least recently used first, until ``wanted`` fits; else raise."""
        need = self._estimate(wanted.slot) + self._pool_budget(wanted.slot)
        wanted.reserved_bytes = 0  # (not counted against itself)
        while self._held() + need > self.budget_bytes:
            candidates = sorted((r for r in self._residents.values()
                                 if r is not wanted and r.state is ModelState.RESIDENT and not r.slot.pinned
                                 and not self._busy(r)), key=lambda r: r.last_used)
            if not candidates:
                raise ModelsBudgetError(self._no_room(wanted, need), retry_after_s=30)
            victim = candidates[0]
            victim.state = ModelState.UNLOADING
            victim.loaded_event.clear()
            self._lock.release()
            try:
                self._stop(victim, f"making room for {wanted.slot.alias}")
            finally:
                self._lock.acquire()
        wanted.reserved_bytes = need  # counted while it loads, so another load makes room for it too

    def _no_room(self, wanted: Resident, need: int) -> str:
        staying = sum(self.default_bytes()) + sum(r.held_bytes for r in self._residents.values()
                                                  if r is not wanted and r.slot.pinned)
        head = (f"model {wanted.slot.alias} needs about {_mib(need)} (weights and KV pool) and the resident "
                f"models hold {_mib(self._held())} of the {_mib(self.budget_bytes)} budget (models_budget_mb)")
        if staying + need > self.budget_bytes:
            return (f"{head}; it does not fit even beside the default and pinned models alone ({_mib(staying)}): "
                    f"raise models_budget_mb or give it a smaller pool (pool=MiB). {self._summary()}")
        return f"{head}, with none that may be unloaded now (serving a turn): {self._summary()}"

    def _stop(self, resident: Resident, reason: str) -> None:
        engine = resident.engine
        if engine is not None:
            engine.stop(self._grace_s)
        with self._lock:
            resident.engine = None
            resident.state = ModelState.UNLOADED
            resident.weights_bytes = resident.pool_bytes = 0
            resident.unloads += 1
            resident.loaded_event.set()
        del engine
        release_memory()
        self._note(EventKind.SWAP, f"model {resident.slot.alias} unloaded ({reason}); its agents stay on disk")

    def stop_all(self) -> None:
        """Shutdown: every extra model's engine stops (hot agents to the warm tier)."""
        self._stopped = True
        for resident in list(self._residents.values()):
            if resident.engine is not None:
                self._stop(resident, "shutdown")

    def _watch_idle(self) -> None:
        while not self._stopped:
            time.sleep(IDLE_POLL_S)
            now = time.monotonic()
            for resident in list(self._residents.values()):
                limit = resident.slot.idle_unload_s
                if (limit and not resident.slot.pinned and resident.state is ModelState.RESIDENT
                        and now - resident.last_used > limit):
                    self.unload(resident.slot.alias, f"idle for {now - resident.last_used:.0f} s")

    # -- accounting ---------------------------------------------------------------------------------
    def _touch(self, resident: Resident, request: bool) -> None:
        now = time.monotonic()
        resident.last_used = now
        if request:
            resident.leased_until = now + LEASE_S
            resident.requests += 1

    def _busy(self, resident: Resident) -> bool:
        engine = resident.engine
        if resident.leased_until > time.monotonic():
            return True
        return engine is not None and engine.turns_in_flight > 0

    def _pool_budget(self, slot: ModelSlot) -> int:
        return int((slot.pool_mb or 0) * 2**20) or self._default_pool_bytes()

    def _default_pool_bytes(self) -> int:
        default = self._default_engine()
        return default.settings.cache.pool_budget_bytes if default is not None else 0

    def default_bytes(self) -> tuple[int, int]:
        """The default model's (weights, KV pool) bytes."""
        default = self._default_engine()
        if default is None:
            return 0, 0
        if self._default_weights is None or self._default_weights[0] != id(default):
            self._default_weights = (id(default), weights_nbytes(default))  # (0 for an engine that stopped)
        return self._default_weights[1], default.pool.total_bytes

    def _held(self) -> int:
        return sum(self.default_bytes()) + sum(r.held_bytes for r in self._residents.values())

    def describe(self) -> list[dict[str, object]]:
        """Every configured model: state, bytes, use (for /v1/models, /v1/stats and the workbench)."""
        weights, pool = self.default_bytes()
        default = self._default_engine()
        now = time.monotonic()
        rows: list[dict[str, object]] = [self._row(self.routes.default, "resident" if default else "unloaded",
                                                   default, weights, pool, None, None, self._default_requests, 1)]
        for r in list(self._residents.values()):
            idle = now - r.last_used if r.last_used else None
            rows.append(self._row(r.slot, r.state.value, r.engine, r.weights_bytes, r.pool_bytes, r.error, idle,
                                  r.requests, r.loads))
        return rows

    def _row(self, slot: ModelSlot, state: str, engine: Engine | None, weights: int, pool: int, error: str | None,
             idle_s: float | None, requests: int, loads: int) -> dict[str, object]:
        snapshot = engine.snapshot() if engine is not None else None
        turns = engine.device_turns if engine is not None else None
        label = engine.loaded.model_id if engine is not None else None
        shares = not slot.is_default and self._is_default_draft(engine)
        return {
            "alias": slot.alias, "source": slot.source, "state": state, "default": slot.is_default,
            "role": slot.role, "pinned": slot.pinned, "idle_unload_s": slot.idle_unload_s,
            "model_id": label, "identity": engine.loaded.identity.key if engine is not None else None,
            "weights_bytes": weights, "pool_bytes": pool,
            "kv_used_bytes": snapshot.pool.used_bytes if snapshot is not None and snapshot.pool else 0,
            "agents": len(snapshot.agents) if snapshot is not None else 0,
            "active_requests": snapshot.throughput.active_requests if snapshot is not None else 0,
            "requests_routed": requests, "loads": loads, "idle_s": idle_s, "error": error,
            "device_wait_s": turns.waited_s.get(label, 0.0) if turns is not None and label else 0.0,
            # Its weights are the default model's draft (--draft-model ALIAS): held once, in that row.
            "drafts_for": self.routes.default.alias if shares else None,
        }

    def budget(self) -> dict[str, int]:
        return {"budget_bytes": self.budget_bytes, "held_bytes": self._held()}

    def _summary(self) -> str:
        weights, pool = self.default_bytes()
        held = [(self.routes.default.alias, weights + pool)] if self._default_engine() is not None else []
        held += [(r.slot.alias, r.held_bytes) for r in self._residents.values() if r.held_bytes]
        listed = ", ".join(f"{alias} {_mib(n)}" + (" (loading)" if self._loading(alias) else "") for alias, n in held)
        return f"resident: {listed or 'none'} (budget {_mib(self.budget_bytes)})"

    def _loading(self, alias: str) -> bool:
        resident = self._residents.get(alias)
        return resident is not None and resident.state is ModelState.LOADING

    def _note(self, kind: EventKind, message: str, level: int = logging.INFO) -> None:
        self._events.emit(kind, message, level=level)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


