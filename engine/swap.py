"""Live model hot-swap that keeps every agent's cache.

One model is loaded at a time. A swap drains the old engine (new requests
wait), spills every hot agent cache to the warm tier (tagged with the old
model), releases the model and the pool, loads the new model and builds a
new engine (pool sized for the new cache spec) that indexes the new model's
warm tier. Swapping back restores the old model's caches from disk.

If the new model fails to load, the previous one is loaded again: the
service never ends up without a model unless the user asked to unload.
"""

from __future__ import annotations

import enum
import gc
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import mlx.core as mx
import psutil

from engine.errors import EngineUnavailableError, ModelSwapError, SemanticError
from engine.models.gguf_import import ImportProgress
from engine.domain.event_log import EventKind
from engine.runtime.engine_thread.snapshot import AgentView

log = logging.getLogger("semantic.swap")

EngineBuilder = Callable[[str, Callable[[ImportProgress], None], tuple[AgentView, ...]], Any]


class SwapPhase(str, enum.Enum):
    IDLE = "idle"
    DRAINING = "draining"
    SPILLING = "spilling"
    UNLOADING = "unloading"
    LOADING = "loading"
    REBUILDING = "rebuilding"
    ROLLING_BACK = "rolling_back"
    DONE = "done"
    FAILED = "failed"
    UNLOADED = "unloaded"


@dataclass(frozen=True, slots=True)
class SwapStatus:
    phase: SwapPhase = SwapPhase.IDLE
    from_model: str | None = None
    to_model: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    spilled_agents: int = 0
    spilled_bytes: int = 0
    cancelled_requests: int = 0
    load_stage: str | None = None
    load_done: int = 0
    load_total: int = 0
    error: str | None = None

    @property
    def running(self) -> bool:
        return self.phase not in (SwapPhase.IDLE, SwapPhase.DONE, SwapPhase.FAILED, SwapPhase.UNLOADED)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


def memory_reading() -> dict[str, int]:
    """Active MLX memory (weights, caches) and process RSS, in bytes."""
    return {"mlx_active": int(mx.get_active_memory()), "rss": int(psutil.Process().memory_info().rss)}


class ModelSwapper:
    """Runs swaps on their own thread; ``status`` is safe to read from anywhere."""

    def __init__(self, service: Any, build_engine: EngineBuilder, current_ref: str) -> None:
        self.service = service
        self.build_engine = build_engine
        self.current_ref = current_ref
        self._status = SwapStatus()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # A request came in while the model was being unloaded: load it again right after.
        self._reload_wanted = False

    @property
    def status(self) -> SwapStatus:
        return self._status

    # -- requests ------------------------------------------------------------------------
    def request(self, ref: str, grace_s: float) -> SwapStatus:
        """Start swapping to ``ref``; raises when a swap is already running."""
        with self._lock:
            if self._status.running:
                raise EngineUnavailableError(f"a swap to {self._status.to_model} is already running", retry_after_s=5)
            self._set(SwapStatus(SwapPhase.DRAINING, self.current_ref, ref, time.time()))
            self.service.close_gate(f"swapping model to {ref}")
            self._thread = threading.Thread(target=self._run, args=(ref, grace_s), name="semantic-swap", daemon=True)
            self._thread.start()
        return self._status

    def unload(self, grace_s: float, reason: str) -> None:
        """Free the model (idle unload); the next request loads it again."""
        with self._lock:
            if self._status.running:
                return
            self._set(SwapStatus(SwapPhase.DRAINING, self.current_ref, None, time.time()))
            self.service.close_gate(f"unloading ({reason})")
        self._retire_old(grace_s)
        with self._lock:
            self._set(replace(self._status, phase=SwapPhase.UNLOADED, finished_at=time.time()))
            wanted, self._reload_wanted = self._reload_wanted, False
        self.service.note(EventKind.SWAP, f"model {self.current_ref} unloaded ({reason})")
        if wanted:
            self.want_model()

    def want_model(self) -> None:
        """A request needs the model: reload it after an idle unload, or as soon as one in progress ends."""
        with self._lock:
            unloading = self._status.running and self._status.to_model is None
            if unloading:
                self._reload_wanted = True
                return
            if self._status.phase is not SwapPhase.UNLOADED:
                return
        try:
            self.request(self.current_ref, 0.0)
        except EngineUnavailableError:
            pass  # another request started the reload first

    def wait(self, timeout_s: float | None = None) -> SwapStatus:
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self._status

    # -- the swap --------------------------------------------------------------------------------
    def _run(self, ref: str, grace_s: float) -> None:
        old_ref = self.current_ref
        seeds = self._retire_old(grace_s)
        try:
            self._load(ref, seeds)
            self.current_ref = ref
            self._finish(SwapPhase.DONE, None)
        except SemanticError as exc:
            self._roll_back(old_ref, seeds, exc)
        except Exception as exc:  # an unexpected loader failure must not leave the service empty
            log.exception("model swap failed")
            self._roll_back(old_ref, seeds, exc)
        finally:
            release_thread_streams()

    def _retire_old(self, grace_s: float) -> tuple[AgentView, ...]:
        engine = self.service.detachable_engine()
        if engine is None:
            return ()
        before = engine.snapshot()
        self._timed(SwapPhase.DRAINING, lambda: self._drain(engine, grace_s))
        self._set(replace(self._status, spilled_agents=before.tiers.hot_agents + before.tiers.cool_agents, spilled_bytes=before.pool.used_bytes if before.pool else 0))
        cancelled = self._timed(SwapPhase.SPILLING, lambda: self._spill(engine))
        seeds = engine.snapshot().agents or before.agents
        self._set(replace(self._status, cancelled_requests=cancelled, memory={"before": memory_reading()["mlx_active"]}))
        self.service.detach()
        del engine
        self._timed(SwapPhase.UNLOADING, release_memory)
        self._record_memory("after_unload")
        return tuple(seeds)

    def _drain(self, engine: Any, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _active_requests(engine) > 0:
            time.sleep(0.05)

    def _spill(self, engine: Any) -> int:
        """Stop the engine: it cancels what still runs and writes every hot cache to disk."""
        still_running = _active_requests(engine)
        engine.stop(0.0)
        return still_running

    def _load(self, ref: str, seeds: tuple[AgentView, ...]) -> None:
        self._set(replace(self._status, phase=SwapPhase.LOADING))
        start = time.monotonic()
        engine = self.build_engine(ref, self._on_progress, seeds)
        self._set(replace(self._status, seconds={**self._status.seconds, "loading": time.monotonic() - start}))
        self._timed(SwapPhase.REBUILDING, lambda: self.service.attach(engine))
        self._record_memory("after")

    def _roll_back(self, old_ref: str, seeds: tuple[AgentView, ...], error: BaseException) -> None:
        message = f"{type(error).__name__}: {error}" if not isinstance(error, SemanticError) else str(error)
        self.service.note(EventKind.ERROR, f"swap to {self._status.to_model} failed: {message}; reloading {old_ref}", logging.ERROR)
        self._set(replace(self._status, phase=SwapPhase.ROLLING_BACK, error=message))
        release_memory()  # whatever the failed load allocated
        try:
            self._load(old_ref, seeds)
        except Exception as again:
            self._finish(SwapPhase.FAILED, f"{message}; reloading {old_ref} also failed: {again}")
            return
        self._finish(SwapPhase.FAILED, message)

    def _finish(self, phase: SwapPhase, error: str | None) -> None:
        self._set(replace(self._status, phase=phase, error=error, finished_at=time.time()))
        self.service.open_gate()
        status = self._status
        if phase is SwapPhase.DONE:
            self.service.note(EventKind.SWAP, f"swapped {status.from_model} -> {status.to_model} in {status.total_seconds:.1f} s "
                                              f"({status.spilled_agents} agents spilled)")

    # -- bookkeeping ---------------------------------------------------------------------------
    def _timed(self, phase: SwapPhase, action: Callable[[], Any]) -> Any:
        self._set(replace(self._status, phase=phase))
        start = time.monotonic()
        result = action()
        self._set(replace(self._status, seconds={**self._status.seconds, phase.value: time.monotonic() - start}))
        return result

    def _on_progress(self, progress: ImportProgress) -> None:
        self._set(replace(self._status, load_stage=progress.stage, load_done=progress.done, load_total=progress.total))

    def _record_memory(self, label: str) -> None:
        self._set(replace(self._status, memory={**self._status.memory, label: memory_reading()["mlx_active"]}))

    def _set(self, status: SwapStatus) -> None:
        self._status = status


def release_thread_streams() -> None:
    """Drop the MLX streams (and compile cache) this thread made, while Python is alive to free them."""
    import mlx.core as mx

    mx.clear_streams()


def release_memory() -> None:
    """Drop the old model's arrays now: collect cycles, then return MLX's cached buffers."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


def ensure_swap_allowed(status: SwapStatus) -> None:
    if status.running:
        raise ModelSwapError(f"a swap to {status.to_model} is already running")


def _active_requests(engine: Any) -> int:
    """Requests the engine is serving now: a snapshot taken for this question (the published one may be
    up to a publishing interval old, and may not yet show a turn that just started); the published one
    where the engine does not answer in time."""
    try:
        return engine.fresh_snapshot(timeout_s=2.0).throughput.active_requests
    except Exception:  # noqa: BLE001 (a stuck or stopped engine: what it last published)
        return engine.snapshot().throughput.active_requests
