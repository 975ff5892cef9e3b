"""The engine's settings for a test, in the sections the engine takes (engine/settings.py)."""

from __future__ import annotations

from engine.settings import BatchSettings, CacheSettings, EngineSettings, TurnSettings


def engine_settings(pool_budget_bytes: int, max_batch_size: int = 8, prefill_step_size: int = 32, *,
                    prefix_sharing: bool = True, kv_bits_at_rest: int | None = None, fast_cpu_math: bool = True,
                    persist_on_exit: bool = True, snapshot_budget_mb: float | None = None,
                    **turns: object) -> EngineSettings:
    """``turns``: any field of ``TurnSettings`` (repetition_window=0, max_queued_requests=1, ...)."""
    return EngineSettings(
        cache=CacheSettings(pool_budget_bytes, prefix_sharing, persist_on_exit, kv_bits_at_rest),
        batch=BatchSettings(max_batch_size, prefill_step_size) if snapshot_budget_mb is None else
        BatchSettings(max_batch_size, prefill_step_size, snapshot_budget_mb=snapshot_budget_mb),
        turns=TurnSettings(**turns),  # type: ignore[arg-type]
        fast_cpu_math=fast_cpu_math,
    )
