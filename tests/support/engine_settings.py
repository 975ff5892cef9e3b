"""The engine's settings for a test, in the sections the engine takes (engine/settings.py)."""

from __future__ import annotations

from engine.settings import BatchSettings, CacheSettings, EngineSettings, SchedulingSettings, TurnSettings


def engine_settings(pool_budget_bytes: int, max_batch_size: int = 8, prefill_step_size: int = 32, *,
                    prefix_sharing: bool = True, kv_bits_at_rest: int | None = None, fast_cpu_math: bool = True,
                    persist_on_exit: bool = True, snapshot_budget_mb: float | None = None,
                    speculate: str | None = None, speculate_max_draft: int | None = None,
                    scheduling: SchedulingSettings | None = None, **turns: object) -> EngineSettings:
    """``turns``: any field of ``TurnSettings`` (repetition_window=0, max_queued_requests=1, ...); None: the
    setting's default."""
    batch = {name: value for name, value in (("snapshot_budget_mb", snapshot_budget_mb), ("speculate", speculate),
                                             ("speculate_max_draft", speculate_max_draft)) if value is not None}
    return EngineSettings(
        cache=CacheSettings(pool_budget_bytes, prefix_sharing, persist_on_exit, kv_bits_at_rest),
        batch=BatchSettings(max_batch_size, prefill_step_size, **batch),  # type: ignore[arg-type]
        turns=TurnSettings(**turns),  # type: ignore[arg-type]
        scheduling=scheduling or SchedulingSettings(),
        fast_cpu_math=fast_cpu_math,
    )
