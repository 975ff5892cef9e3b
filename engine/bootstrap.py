"""The composition root: Settings in, a running Engine out."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterable

import mlx.core as mx

from engine.distributed.lockstep import Lockstep
from engine.distributed.stall_guard import StallGuard
from engine.distributed.world import World
from engine.errors import ModelLoadError, SemanticError
from engine.domain.model_slots import ModelSlot
from engine.models.gguf_import import ImportProgress
from engine.models.loaded import LoadedModel
from engine.models.loader import load_model
from engine.runtime.engine_thread.device_turns import DeviceTurns
from engine.runtime.engine_thread.engine import Engine
from engine.domain.event_log import EventKind, EventLog
from engine.runtime.engine_thread.snapshot import AgentView
from engine.settings import EngineSettings, Settings
from engine.store.temp_files import sweep_dead_temps
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model

if TYPE_CHECKING:
    from engine.resident_models import ResidentModels

log = logging.getLogger("semantic")


def load_configured_model(
    settings: Settings, progress: Callable[[ImportProgress], None] | None = None, ref: str | None = None,
    world: "World | None" = None,
) -> LoadedModel:
    loaded = load_model(
        ref or settings.model,
        settings.cache_dir,
        settings.block_tokens,
        dtype=settings.weights_dtype,
        progress=progress,
        trust_remote_code=settings.trust_remote_code,
        world=world,
        shard_mode=settings.shard_mode,
    )
    if settings.speculate == "draft" and settings.draft_model:
        try:
            loaded = with_draft_model(settings, loaded, world)
        except ModelLoadError as exc:
            if ref is None:  # the configured model: the user named the draft model for it
                raise
            # A swap to another model: the draft model may not fit it (another tokenizer); the swap goes on
            # and this model's agents draft by lookup.
            log.warning("%s; drafting by lookup for %s", exc, loaded.model_id)
    # Loading evaluates weights on this thread's stream; drain it before the
    # engine thread takes over (queued work at exit aborts MLX).
    mx.synchronize()
    return loaded


def with_draft_model(settings: Settings, loaded: LoadedModel, world: "World | None" = None) -> LoadedModel:
    """``loaded`` with ``settings.draft_model`` beside it (ModelLoadError naming what does not fit)."""
    from dataclasses import replace

    from engine.models.draft_model import load_draft_model

    if world is not None and world.size > 1:
        raise ModelLoadError("a draft model (--draft-model) is not available with ranks: each rank holds a "
                             "shard of the served model; use --speculate lookup")
    assert settings.draft_model is not None
    draft = load_draft_model(draft_source(settings), loaded, settings.cache_dir, settings.weights_dtype,
                             settings.trust_remote_code)
    return replace(loaded, draft=draft)  # (build_engine's event says which model drafts for which)


def draft_source(settings: Settings) -> str:
    """What ``--draft-model`` loads: an extra model's source when it names one by alias (that model then
    serves with the draft's weights), else the reference as given."""
    from engine.domain.model_slots import model_slots

    slot = next((s for s in model_slots(settings.model, settings.extra_models)[1:]
                 if s.alias == settings.draft_model), None) if settings.extra_models else None
    return slot.source if slot is not None else str(settings.draft_model)


def build_engine(
    settings: Settings, loaded: LoadedModel, events: EventLog | None = None, seed_agents: Iterable[AgentView] = (),
    world: "World | None" = None, device_turns: DeviceTurns | None = None,
) -> Engine:
    events = events or EventLog()
    # The hot pool's K/V quantization is the pool's, not the model's layout: the store (which rests caches as
    # the pool holds them) and the engine both see it in the spec.
    loaded = replace(loaded, spec=loaded.spec.with_hot_kv(settings.hot_kv_bits, settings.kv_group_size))
    store = WarmStore(settings.agents_dir, stored_model(loaded), settings.disk_budget_bytes, events,
                      kv_bits_at_rest=settings.bits_at_rest)
    lockstep = Lockstep(world) if world is not None else None
    engine = Engine(loaded, EngineSettings.of(settings), store=store, events=events, seed_agents=seed_agents,
                    lockstep=lockstep, device_turns=device_turns)
    events.emit(EventKind.LOAD, f"loaded {loaded.model_id} ({loaded.architecture}, context {loaded.context_length})")
    if loaded.draft is not None and settings.speculate == "draft":
        events.emit(EventKind.LOAD, f"draft model {loaded.draft.model_id} drafts for {loaded.model_id}")
    return engine


def start_engine(settings: Settings, progress: Callable[[ImportProgress], None] | None = None,
                 world: "World | None" = None, events: EventLog | None = None) -> Engine:
    """Load, build and start; with a ``world`` of several ranks, this rank's shard in lockstep with the others.

    First the temporary files of writers that died (a crash, a kill) go: nothing needs cleaning by hand."""
    sweep_dead_temps(settings.cache_dir)
    if settings.extra_models and world is not None and world.size > 1:
        raise ModelLoadError("--extra-model is not available with ranks (mlx.launch): every rank holds a shard "
                             "of one model")
    # Several resident models take turns on the device (engine_thread/device_turns.py).
    turns = DeviceTurns() if settings.extra_models else None
    engine = build_engine(settings, load_configured_model(settings, progress, world=world), events, world=world,
                          device_turns=turns)
    await_warm_up(engine, progress)
    engine.start(timeout_s=None if world is not None else 120.0)
    if world is not None:
        StallGuard(lambda: engine.heartbeat, lambda: engine.is_running, settings.rank_timeout_s, world.label,
                   world.peers_described()).start()
    return engine


def await_warm_up(engine: Engine, progress: Callable[[ImportProgress], None] | None) -> None:
    """What the backend loads in the background (the CPU's compiled loops; compiled on a fresh install) is
    loaded before the engine says ready, each stage reported as the model's load stages are."""
    report = (lambda what, done, total: progress(ImportProgress(what, done, total))) if progress else None
    engine.backend.await_warm_up(report)


def release_mlx() -> None:
    """Free every unreferenced MLX array now, on this thread, and drain the streams.

    Call it after the engine stopped and the caller dropped its references.
    Arrays left for interpreter teardown (weights made on a loader thread,
    the last batch on the engine thread) abort the process about half the
    time ("terminate called without an active exception", status 134).
    """
    import gc

    gc.collect()
    mx.synchronize()


def engine_builder(settings: Settings, events: EventLog, device_turns: DeviceTurns | None = None
                   ) -> Callable[..., Engine]:
    """What a model swap calls to bring up the next engine (blocking; swap thread)."""

    def build(ref: str, progress: Callable[[ImportProgress], None], seeds: Iterable[AgentView]) -> Engine:
        engine = build_engine(settings, load_configured_model(settings, progress, ref=ref), events, seeds,
                              device_turns=device_turns)
        await_warm_up(engine, progress)
        engine.start()
        return engine

    return build


def slot_settings(settings: Settings, slot: ModelSlot) -> Settings:
    """The settings an extra model's engine runs with: its source, its pool; it drafts by lookup (a draft
    model is the default model's)."""
    update: dict[str, object] = {"model": slot.source, "draft_model": None,
                                 "speculate": "lookup" if settings.speculate == "draft" else settings.speculate}
    if slot.pool_mb is not None:
        update["pool_budget_mb"] = slot.pool_mb
    return settings.model_copy(update=update)


def slot_engine_builder(settings: Settings, events: EventLog, device_turns: DeviceTurns | None,
                        default_engine: Callable[[], Engine | None] = lambda: None) -> Callable[[ModelSlot], Engine]:
    """What the resident set calls to bring up an extra model's engine (blocking; a worker thread).

    The extra model ``--draft-model`` names by alias serves with the default model's draft's weights: one
    copy in memory, drafting for the default model and serving its own requests."""

    def build(slot: ModelSlot) -> Engine:
        own = slot_settings(settings, slot)
        default = default_engine()
        draft = default.loaded.draft if default is not None and settings.draft_model == slot.alias else None
        loaded = draft.loaded if draft is not None and draft.loaded is not None else load_configured_model(own)
        engine = build_engine(own, loaded, events, device_turns=device_turns)
        await_warm_up(engine, None)
        engine.start()
        return engine

    return build


def resident_models(settings: Settings, default_engine: Callable[[], Engine | None], events: EventLog,
                    device_turns: DeviceTurns | None) -> "ResidentModels | None":
    """The extra models of ``--extra-model`` (None without any): not loaded yet but the pinned ones, on
    ``load_pinned``."""
    if not settings.extra_models:
        return None
    from engine.domain.model_slots import ModelRoutes, model_slots
    from engine.platform.memory import read_memory
    from engine.resident_models import ResidentModels

    slots = model_slots(settings.model, settings.extra_models)
    routes = ModelRoutes.of(slots, settings.model_routes)
    budget_mb = settings.models_budget_mb
    budget = int(budget_mb * 2**20) if budget_mb is not None else int(read_memory().system_total * 0.85)
    return ResidentModels(routes, budget, slot_engine_builder(settings, events, device_turns, default_engine),
                          default_engine,
                          events, settings.swap_grace_s, estimate_bytes=lambda slot: _folder_bytes(settings, slot))


def _folder_bytes(settings: Settings, slot: ModelSlot) -> int:
    """Before a model loads: its weights' bytes on disk, as the registry knows them (0 when unknown)."""
    from engine.models.registry import ModelRegistry

    try:
        registry = ModelRegistry(settings.models_dir)
        entry = registry.find(slot.source) or registry.add(slot.source)
    except SemanticError:
        return 0
    return entry.size_bytes or 0
