"""The engine: one thread that owns MLX, the model, the pool and the batch.

Every other thread talks to it through ``submit``/``cancel``/``call``, which
put commands on a queue, and reads ``snapshot()``, an immutable value the
engine thread republishes a few times a second.
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

import mlx.core as mx

from engine.domain.block_pool import BlockPool
from engine.domain.event_log import EventKind, EventLog
from engine.domain.requests import EventSink, FinishEvent, FinishReason, GenerationRequest, clamped
from engine.errors import (
    EngineUnavailableError,
    PromptTooLongError,
    QueueFullError,
    RequestTooLargeForPoolError,
)
from engine.grammar.output_grammars import OutputGrammars
from engine.models.draft_model import speculation_mode
from engine.models.loaded import LoadedModel
from engine.models.sampling_defaults import model_sampling_defaults
from engine.platform import heap
from engine.platform.memory import read_memory
from engine.runtime.engine_thread.agent_ops import AgentOps
from engine.runtime.engine_thread.arrival_window import ArrivalWindow
from engine.runtime.engine_thread.device_turns import CONTENDED_PREFILL_TOKENS, DeviceTurns
from engine.runtime.engine_thread.engine_ops import EngineOp
from engine.runtime.engine_thread.engine_seams import EngineSeams
from engine.runtime.engine_thread.ranks import Ranks, SoleRank
from engine.runtime.engine_thread.replica import Replica
from engine.runtime.engine_thread.snapshot import AgentView, EngineSnapshot
from engine.runtime.engine_thread.snapshot_builder import SnapshotSources, build_snapshot
from engine.runtime.memory_pressure import MemoryWatch, Watermarks
from engine.runtime.runner.backends import choose_backend
from engine.runtime.scheduler.memory_policy import MemoryPolicy
from engine.runtime.scheduler.parts import SchedulerState
from engine.runtime.scheduler.scheduler import BatchHooks, Scheduler
from engine.runtime.scheduler.turn import Turn, admission_tokens
from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.agents import Tier
from engine.runtime.tiers.hot import HotCache
from engine.runtime.tiers.manager import TierManager
from engine.settings import EngineSettings
from engine.store.kv_at_rest import quantization_for

if TYPE_CHECKING:
    from engine.distributed.lockstep import Lockstep
    from engine.store.warm_store import WarmStore

T = TypeVar("T")
log = logging.getLogger("semantic.engine")


# How often the engine republishes its snapshot, and how long an idle loop waits for a command.
SNAPSHOT_INTERVAL_S = 0.2
IDLE_WAIT_S = 0.05


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        settings: EngineSettings,
        *,
        store: "WarmStore | None" = None,
        events: EventLog | None = None,
        seed_agents: Iterable[AgentView] = (),
        lockstep: "Lockstep | None" = None,
        device_turns: DeviceTurns | None = None,
        seams: EngineSeams = EngineSeams(),
    ) -> None:
        self.loaded = loaded
        # Several resident models: their engines take turns on the device, a step each (device_turns.py).
        self.device_turns = device_turns
        # How the model is computed (runner/backends/): given, else chosen for this device and the settings.
        self.backend = seams.backend if seams.backend is not None else choose_backend(settings.fast_cpu_math)
        # Why the engine thread ended on its own (a rank lost, ranks diverged); None while it runs
        # or after a requested stop. ``on_failure`` (set by the owner) hears of it at once.
        self.failure: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        # Agents known before a model swap: they keep their identity here even
        # when this model holds no cache for them yet.
        self._seeds = tuple(seed_agents)
        self.settings = settings
        self.events = events or EventLog()
        self._store = store
        self._batch_factory = seams.batch_factory
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        # Held while a turn is checked and queued, and while shutdown closes the door: a turn is
        # either refused or queued before the last drain, never left in a queue nobody reads.
        self._door = threading.Lock()
        self._closed = False
        self._validation_mark = secrets.token_hex(8)  # (stamped on what validate() checked: validated once)
        # Turns submitted and not finished (turns_in_flight), counted on the client's thread and the engine's.
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        # The watchdog's evidence, written by the engine thread and read by anyone (floats and bools
        # are replaced atomically): when the loop last finished a pass, and whether work was waiting.
        self._beat = time.monotonic()
        self._busy = False
        self._arrivals = ArrivalWindow(self.settings.batch.batch_window_ms / 1000)
        self._status = "starting"
        self._startup_error: BaseException | None = None
        self._snapshot = EngineSnapshot(status="starting", model=None, pool=None)
        self._set_up_caches(store)
        # Under a sharded model: rank 0 sends this engine's inputs to the other ranks, which replay
        # them (engine_thread/replica.py). None: this process holds the whole model.
        self._ranks: Ranks = (Replica(lockstep, self.agents, self.events, lambda op: op(self))
                              if lockstep is not None else SoleRank())
        # What requests that name no temperature sample with (engine/models/sampling_defaults.py).
        sampling = settings.sampling
        self.sampling_defaults = model_sampling_defaults(loaded.model_id, loaded.path).with_overrides(
            sampling.default_temperature, sampling.default_top_p, sampling.default_top_k)
        self.scheduler: Scheduler | None = None
        # Structured outputs: the model's tokenizer table and compiled schemas (the API compiles, turns copy).
        self.grammars = OutputGrammars(loaded.tokenizer, loaded.eos_token_ids,
                                       close_loops=settings.turns.close_constrained_loops)
        # Memory watermarks (runtime/memory_pressure.py) and what the engine does about them
        # (scheduler/memory_policy.py). Not under lockstep: every rank would have to give way at the same point
        # of its loop, and each reads its own machine.
        self.memory = seams.memory if seams.memory is not None or not self._ranks.alone else _memory_watch(settings)
        self.memory_policy = MemoryPolicy(self.memory, self._pool, self.tiers, self.events)

    def _set_up_caches(self, store: "WarmStore | None") -> None:
        """The pool, the agents, the tiers over them, and what clients may do to agents."""
        loaded, cache = self.loaded, self.settings.cache
        self._pool = BlockPool.from_budget(loaded.spec, cache.pool_budget_bytes)
        self.agents = AgentTable(self.settings.scheduling.policy())
        # Prefixes are shared by reference where the model's attention can be hooked (kv/ragged.py) and the
        # model reads no fetched K/V itself (a latent model's rows are fetched whole: kv/padded.py).
        hooked = self.backend.attach(loaded.model, batchable=loaded.spec.batchable)
        self.hot = HotCache(loaded.spec, self._pool, share_by_reference=hooked and not loaded.spec.latent,
                            kinds=self.backend.kinds_for(loaded.spec))
        # (A pool that quantizes its K/V keeps no cool tier: an idle agent's blocks already are what it would be.)
        cool = None if loaded.spec.kv_bits is not None else quantization_for(cache.kv_bits_at_rest, *loaded.spec.head_dims)
        self.tiers = TierManager(self.hot, self.agents, self.events, store, cool=cool)
        # Evict, pin, delete, fork, rewind, export, import: the commands ranks replay (engine_ops.EngineOp).
        self.ops = AgentOps(self.agents, self.hot, self.tiers, self.events, store, loaded.shard)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout_s: float | None = 120.0) -> None:
        self._thread = threading.Thread(target=self._run, name="semantic-engine", daemon=True)
        self._thread.start()
        atexit.register(self.stop, 0.0)
        if not self._ready.wait(timeout_s):
            raise EngineUnavailableError("engine thread did not start in time")
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, grace_s: float = 10.0) -> None:
        """Let running turns finish for ``grace_s``, cancel the rest, persist, and join."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._grace_deadline = time.monotonic() + grace_s
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join()
        atexit.unregister(self.stop)

    def wait(self, poll_s: float = 0.5) -> None:
        """Until the engine thread ends (a sharded model's other ranks: when rank 0 ends the run)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(poll_s)  # in slices, so the main thread still runs its signal handlers

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- client API (any thread) ------------------------------------------------------------
    def submit(self, request: GenerationRequest, sink: EventSink) -> str:
        """Queue a turn; events for it go to ``sink`` (called on the engine thread: keep it cheap)."""
        request = self.validate(request)
        request = self._ranks.seeded(request)
        self.memory_policy.refuse_under_hard_pressure()
        queued = len(self.scheduler.waiting) + self._commands.qsize() if self.scheduler is not None else 0
        limit = self.settings.turns.max_queued_requests
        if queued >= limit:
            raise QueueFullError(f"{queued} requests are already waiting for the engine "
                                 f"(max_queued_requests {limit}); retry shortly")
        with self._door:
            if self._closed or self._stop.is_set() or not self.is_running:
                raise EngineUnavailableError("engine is not running", retry_after_s=5)
            turn = Turn(request, self._counted(sink))
            self._commands.put(lambda: self._submit(turn))
        return request.request_id

    def _counted(self, sink: EventSink) -> EventSink:
        """``sink``, counting the turn in flight from now (it is queued) until its finish event."""
        with self._in_flight_lock:
            self._in_flight += 1
        settled = False

        def counted(event: Any) -> None:
            nonlocal settled
            if isinstance(event, FinishEvent) and not settled:
                settled = True
                with self._in_flight_lock:
                    self._in_flight -= 1
            sink(event)

        return counted

    @property
    def turns_in_flight(self) -> int:
        """Turns submitted and not yet finished (any thread): a model with any may not be unloaded."""
        return self._in_flight

    def set_memory_watermarks(self, watermarks: Watermarks) -> None:
        """New watermarks from now on (any thread); judged at the engine's next sample."""
        self.memory_policy.set_watermarks(watermarks)

    def _submit(self, turn: Turn) -> None:
        self._record("submit", turn.request, turn.submitted_at)
        self._arrivals.arrived(turn.submitted_at)
        self._scheduler().submit(turn)

    def validate(self, request: GenerationRequest) -> GenerationRequest:
        """Reject what can never run, and clamp ``max_tokens``, the one place it is clamped: to
        ``max_output_tokens`` (the request then says what it asked) and to what the context leaves. Raises
        domain errors. A request this engine validated already (the API validates before it answers, then
        submits) is returned as it is."""
        if request.validated_by == self._validation_mark:
            return request
        limit = self.context_length
        n = len(request.prompt_tokens)
        if n + 1 > limit:
            raise PromptTooLongError(n, limit)
        request = clamped(request, self.settings.turns.max_output_tokens, limit - n)
        reserved = admission_tokens(request)
        needed = self.loaded.spec.total_blocks_for_tokens(reserved)
        if needed > self._pool.total_blocks:
            answer = f" and the {reserved - n} answer positions a side request reserves" if reserved > n + 1 else ""
            raise RequestTooLargeForPoolError(
                f"a prompt of {n} tokens{answer} needs {needed} KV blocks "
                f"({needed * self._pool.block_bytes / 2**20:.0f} MiB) but the whole pool holds "
                f"{self._pool.total_blocks} blocks ({self._pool.total_bytes / 2**20:.0f} MiB); raise pool_budget_mb",
                field="messages",
            )
        return replace(request, validated_by=self._validation_mark)

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        def command() -> None:
            self._record("cancel", request_id, reason)
            self._scheduler().cancel(request_id, reason)

        self._commands.put(command)

    def watch(self, agent_id: str, sink: EventSink) -> None:
        """Receive the events of every turn of ``agent_id`` (also HTTP ones) until ``unwatch``."""
        self._commands.put(lambda: self._scheduler().watch(agent_id, sink))

    def unwatch(self, agent_id: str, sink: EventSink) -> None:
        self._commands.put(lambda: self._scheduler().unwatch(agent_id, sink))

    def call(self, fn: Callable[["Engine"], T]) -> "Future[T]":
        """Run ``fn(engine)`` on the engine thread; the future carries its result or exception.

        What changes engine state must be an ``EngineOp`` (engine_ops.py): under a sharded model the
        other ranks apply it too. A plain function runs on this rank alone and may only read.
        """
        future: Future[T] = Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            if isinstance(fn, EngineOp):
                self._record("call", fn)
            try:
                future.set_result(fn(self))
            except BaseException as exc:  # handed to the caller, never kills the thread
                future.set_exception(exc)

        with self._door:
            if self._closed:
                future.set_exception(EngineUnavailableError("engine is not running", retry_after_s=5))
            else:
                self._commands.put(command)
        return future

    def snapshot(self) -> EngineSnapshot:
        """The latest published state (at most ``snapshot_interval_s`` old)."""
        return self._snapshot

    def publish_now(self) -> EngineSnapshot:
        """Engine thread: publish a snapshot of the state as it is, and return it."""
        self._publish(force=True)
        return self._snapshot

    def fresh_snapshot(self, timeout_s: float = 30.0) -> EngineSnapshot:
        """A snapshot taken after every command queued so far has run."""
        self.call(lambda engine: engine._publish(force=True)).result(timeout_s)
        return self._snapshot

    @property
    def heartbeat(self) -> float:
        """When the engine loop last finished a pass (monotonic seconds)."""
        return self._beat

    def stalled_for(self) -> float | None:
        """Seconds the engine has been stuck (no pass of its loop while work waits), or None.

        Judged by the caller's clock against the engine thread's last heartbeat,
        so a thread hung inside an MLX call is seen from outside.
        """
        if not self.is_running or not self._busy:
            return None
        quiet = time.monotonic() - self._beat
        return quiet if quiet >= self.settings.turns.watchdog_s else None

    @property
    def context_length(self) -> int:
        cap = self.settings.turns.max_context_tokens
        if cap is not None:
            return min(cap, self.loaded.context_length)
        return self.loaded.context_length

    @property
    def rank_reports(self) -> tuple[Any, ...]:
        """Every rank's report from the last lockstep tick (empty when this process runs alone)."""
        return self._ranks.reports

    @property
    def pool(self) -> BlockPool:
        return self._pool

    def _scheduler(self) -> Scheduler:
        assert self.scheduler is not None, "engine thread not started"
        return self.scheduler

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._ranks.agree_on_settings(self.loaded.identity.key, self._pool.total_blocks,
                                          self.loaded.spec.block_bytes, self.settings,
                                          self.sampling_defaults.describe())
            self._index_store()
            self._settle_disk_budget()
            # Under lockstep every rank must decide alike from the same inputs: the batch may not keep time.
            self.scheduler = Scheduler(self.loaded, SchedulerState(self.hot, self.agents, self.tiers, self.events),
                                       self.settings, BatchHooks(self.backend, timed=self._ranks.alone),
                                       self._batch_factory, self.grammars)
            self.ops.priorities = self.scheduler.priorities
        except BaseException as exc:
            self._startup_error = exc
            self._status = "failed"
            self._ready.set()
            return
        self._status = "ready"
        self.events.emit(EventKind.LOAD, f"{self.loaded.model_id}: layer groups {self.loaded.spec.layer_summary()}")
        if self.loaded.spec.kv_bits is not None:
            self.events.emit(EventKind.LOAD, f"{self.loaded.model_id}: hot K/V {self.loaded.spec.hot_kv_summary()}")
        self.events.emit(EventKind.LOAD, f"engine ready: {self.loaded.model_id}, {self._pool.total_blocks} blocks; "
                         f"requests without a temperature sample with {self.sampling_defaults.describe()}")
        self._publish(force=True)
        heap.settle()  # (after loading, before the first request: engine/platform/heap.py)
        self._ready.set()
        try:
            self._loop()
        except Exception as exc:
            if self._ranks.alone:
                raise
            self._fail(exc)
        finally:
            self._shutdown()

    def _fail(self, exc: Exception) -> None:
        """Lockstep broke (a rank died, ranks diverged): this rank stops, and says why."""
        exc = self._ranks.explain(exc)  # type: ignore[assignment]
        self.failure = exc
        self._status = "failed"
        log.error("engine stopped: %s", exc)
        self.events.emit(EventKind.ERROR, f"engine stopped: {exc}", level=logging.ERROR)
        if self.on_failure is not None:
            self.on_failure(exc)

    def _index_store(self) -> None:
        """Agents from earlier runs (warm ones resume from disk, cold ones are listed) and from before a swap."""
        self._ranks.index_store(self.agents, self._store, self._seeds, self.events)

    def _settle_disk_budget(self) -> None:
        """Before ready: a process killed between a write and the budget's next pass (or mid-swap, after
        spilling every agent) leaves the warm tier over its disk budget. Its oldest agents go cold now, files
        deleted, so a ready server lists every agent in the tier its files say (found crash-testing with
        swaps: a warm agent listed at ready lost its file to the first loop's budget pass)."""
        if self._store is None:
            return
        self.tiers.poll()
        self._store.flush()  # (the deletes run on the store's I/O thread)
        self.tiers.poll()

    def _loop(self) -> None:
        scheduler = self._scheduler()
        last = 0.0
        completed = 0
        while True:
            stop = self._take_inputs(scheduler)
            self.tiers.poll()
            if stop:
                return
            self.memory_policy.each_pass(scheduler.admission, scheduler.queues.running_agents())
            self._busy = scheduler.has_work  # before the step: a step that hangs leaves it set
            self._step_once(scheduler)
            self._busy = scheduler.has_work
            now = self._beat = time.monotonic()
            # After a turn ends its client may ask about the agent at once: publish then too.
            if now - last >= SNAPSHOT_INTERVAL_S or scheduler.completed != completed:
                self._publish()
                last, completed = now, scheduler.completed

    def _take_inputs(self, scheduler: Scheduler) -> bool:
        """This pass's commands, and under lockstep the tick every rank applies. True: stop now."""
        ranks = self._ranks
        stop = False
        if ranks.is_root:
            # Wait for commands only when nothing is decoding, and only briefly
            # when turns are queued behind a disk read.
            idle = not scheduler.queues.by_uid
            self._run_commands(block=idle, timeout=max(self._idle_wait(scheduler), ranks.pause_s))
            if idle and scheduler.waiting:
                self._gather_arrivals(scheduler.waiting)
            stop = self._stop.is_set() and self._drained_or_late(scheduler)
        else:
            self._sleep_out(ranks.pause_s)  # running this rank's own reads (snapshots) meanwhile
        return ranks.tick(scheduler, stop)

    def _sleep_out(self, pause_s: float) -> None:
        """A follower waits out rank 0's announced pause here, not spinning inside the next tick's collective."""
        deadline = time.monotonic() + pause_s
        self._run_commands(block=False, timeout=0)
        while (left := deadline - time.monotonic()) > 0:
            self._run_commands(block=True, timeout=left)

    def _record(self, kind: str, *args: Any) -> None:
        """Rank 0: an input the other ranks replay at the same point (nothing without lockstep)."""
        self._ranks.record(kind, *args)

    def _gather_arrivals(self, waiting: Iterable[Turn]) -> None:
        """An idle engine that just got work waits one short window for more, while requests have been
        arriving together (arrival_window.py)."""
        turns = list(waiting)
        window = self._arrivals.woke(min(t.submitted_at for t in turns), len(turns))
        deadline = time.monotonic() + window
        while (left := deadline - time.monotonic()) > 0:
            try:
                command = self._commands.get(timeout=left)
            except queue.Empty:
                return
            self._run_one(command)

    def _drained_or_late(self, scheduler: Scheduler) -> bool:
        if not scheduler.has_work:
            return True
        if time.monotonic() >= self._grace_deadline:
            self._record("cancel_all", FinishReason.CANCELLED)
            scheduler.cancel_all(FinishReason.CANCELLED)
            return True
        return False

    def _step_once(self, scheduler: Scheduler) -> None:
        turns = self.device_turns
        if turns is None or not scheduler.has_work:
            self._admit_and_step(scheduler)
        else:
            with turns.turn(self.loaded.model_id):
                # Another model waiting: prefill in short slices, so its tokens keep coming (device_turns.py).
                contended = turns.contended(self.loaded.model_id)
                scheduler.limit_prefill(min(CONTENDED_PREFILL_TOKENS, self.settings.batch.prefill_step_size)
                                        if contended else self.settings.batch.prefill_step_size)
                self._admit_and_step(scheduler)
        self._ranks.after_step(scheduler, self._pool.used_blocks)

    def _admit_and_step(self, scheduler: Scheduler) -> None:
        try:
            scheduler.admit()
            scheduler.step()
        except Exception as exc:
            if not self._ranks.alone:
                # A rank cannot fail its turns alone: its peers would wait in the next collective.
                raise
            log.exception("engine step failed")
            self.events.emit(EventKind.ERROR, f"engine step failed: {type(exc).__name__}: {exc}", level=logging.ERROR)
            scheduler.fail_all(exc)

    def _idle_wait(self, scheduler: Scheduler) -> float:
        return 0.005 if scheduler.waiting else IDLE_WAIT_S

    def _run_commands(self, block: bool, timeout: float) -> None:
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            if block:
                self._publish()
            return
        while True:
            self._run_one(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_one(self, command: Callable[[], None]) -> None:
        try:
            command()
        except Exception as exc:  # a bad command must not stop the engine
            log.exception("engine command failed")
            self.events.emit(EventKind.ERROR, f"command failed: {exc}", level=logging.ERROR)

    def _shutdown(self) -> None:
        self._status = "stopping"
        scheduler = self._scheduler()
        with self._door:
            self._closed = True
        # Turns queued before the door closed are taken in, then cancelled with the rest (a 503).
        self._run_commands(block=False, timeout=0)
        scheduler.cancel_all(FinishReason.CANCELLED)
        self._persist_all()
        self._release_hot()
        scheduler.close()
        # Anything left in reference cycles is collected here, on the thread
        # whose stream made its arrays.
        heap.release()
        gc.collect()
        mx.synchronize()
        # This thread's streams and compile cache (mlx.nn's activations are
        # mx.compile'd) must go while Python is alive: their thread-exit
        # destructors need the GIL, and a thread that exits while the
        # interpreter finalizes aborts the process (MLX's documented pattern).
        mx.clear_streams()
        self.backend.detach(self.loaded.model)
        self.backend.close()
        self._status = "stopped"
        self._publish(force=True)
        # A stopped engine may still be referenced (a watching chat pane, a
        # late request); it must not keep the model's weights alive.
        self.loaded = replace(self.loaded, model=None)
        self.scheduler = None

    def _release_hot(self) -> None:
        """Free every block on this thread: MLX aborts the process if arrays made
        here are only freed during interpreter teardown."""
        for agent in self.agents:
            if agent.tier in (Tier.HOT, Tier.COOL):
                agent.stored(agent.cached_tokens, agent.stored_bytes)
                self.hot.drop(agent)
                agent.uncooled()
                agent.move_to(Tier.COLD)

    def _persist_all(self) -> None:
        if self._store is None:
            return
        if self.settings.cache.persist_on_exit and self.failure is None:
            # After a lost rank this rank's shard alone could not be restored: the files from the
            # last clean stop stay the agents' warm copies.
            for agent in self.agents:
                if agent.tier in (Tier.HOT, Tier.COOL) and not agent.auxiliary:
                    self.tiers.evict(agent, Tier.WARM, reason="shutdown")
        self._store.close()

    def _publish(self, force: bool = False) -> None:
        sources = SnapshotSources(self.loaded, self._pool, self.agents, self.tiers, self.scheduler,
                                  self.backend.describe(), self.sampling_defaults.describe(), self.context_length,
                                  self.rank_reports, self.memory.describe() if self.memory is not None else None,
                                  speculation_mode(self.settings.batch.speculate, self.loaded))
        self._snapshot = build_snapshot(sources, self._status)


def _memory_watch(settings: EngineSettings) -> MemoryWatch:
    memory = settings.memory
    total = read_memory().system_total
    return MemoryWatch(Watermarks.for_machine(total, memory.memory_soft_limit_mb, memory.memory_hard_limit_mb))
