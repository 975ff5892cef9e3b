"""Real models loaded once per session, and engines built around them."""

from __future__ import annotations

from pathlib import Path

from engine.models.loaded import LoadedModel
from engine.models.loader import load_model
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings

BLOCK_TOKENS = 256


def load_folder(folder: Path, cache_dir: Path) -> LoadedModel:
    return load_model(str(folder), cache_dir, BLOCK_TOKENS)


def start_engine(loaded: LoadedModel, budget_mb: float = 1024, batch: int = 16, prefill_step: int = 512, store=None,
                 **settings: object) -> Engine:
    """``settings``: more of ``engine_settings`` (speculate="off", ...)."""
    config = engine_settings(int(budget_mb * 2 ** 20), batch, prefill_step, **settings)  # type: ignore[arg-type]
    engine = Engine(loaded, config, store=store)
    engine.start()
    return engine
