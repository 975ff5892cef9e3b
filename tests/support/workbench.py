"""The workbench app wired to a ScriptedEngine, for pilot and snapshot tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.settings import load_settings
from semantic_tui.app import SemanticApp
from semantic_tui.backend import WorkbenchBackend
from semantic_tui.preferences import load_preferences

from .scripted_engine import ScriptedEngine


def scripted_factory(engine: ScriptedEngine):
    def factory(settings, events, progress) -> Any:
        from engine.models.gguf_import import ImportProgress

        for done in range(3):
            progress(ImportProgress("loading", done, 2))
        engine.events = events
        return engine

    return factory


def scripted_swaps(ref: str, progress, seeds) -> ScriptedEngine:
    """Swap builder: a scripted engine named after the model it was asked for."""
    from engine.models.gguf_import import ImportProgress

    from .scripted_engine import scripted_loaded

    progress(ImportProgress("loading", 1, 1))
    return ScriptedEngine(lambda r: f"I am {ref}", loaded=scripted_loaded(name=Path(ref).name), seed_agents=tuple(seeds))


def workbench(tmp_path: Path, engine: ScriptedEngine | None = None, **settings: Any) -> SemanticApp:
    config = load_settings(cache_dir=tmp_path / "cache", port=0, preload_openblas=False, **settings)
    backend = WorkbenchBackend(config, scripted_factory(engine or ScriptedEngine()), swap_builder=scripted_swaps)
    prefs = load_preferences(tmp_path / "workbench.json")
    return SemanticApp(backend, prefs, poll_interval_s=0.1)
