"""An agent the workbench acts on, and the model that holds its cache.

With several resident models (``--extra-model``) the agents table lists every
model's agents; a row's actions (chat, fork, rewind, export, cache history,
evict, pin) must reach the engine of the row's own model, and the side panes
(pool map, tiers, throughput) show that model. ``model`` is the extra model's
alias, or None for the default model's agents, which go through the service
as ever (its engine may be replaced by a swap between two calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from engine.errors import EngineUnavailableError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """One serving model, as the workbench reaches it: its alias (None: the default model) and its engine."""

    model: str | None
    engine: Any = None  # an extra model's Engine; None: the service's current engine

    def snapshot(self, service: Any) -> Any:
        return self.engine.snapshot() if self.engine is not None else service.snapshot()

    def running_engine(self, service: Any) -> Any:
        return self.engine if self.engine is not None else service.engine

    async def call(self, service: Any, fn: Callable[[Any], T]) -> T:
        """``fn(engine)`` on this model's engine thread."""
        return await (service.call_on(self.engine, fn) if self.engine is not None else service.call(fn))

    @property
    def suffix(self) -> str:
        """' (alias)' for an extra model's agent, '' for the default model's: what notices append."""
        return f" ({self.model})" if self.model is not None else ""


def model_target(service: Any, model: str | None) -> ModelTarget:
    """The target for ``model`` (an extra model's alias, or None); EngineUnavailableError when that model
    is not serving now (unloaded since the table was drawn)."""
    if model is None:
        return ModelTarget(None)
    engine = dict(service.served_engines()).get(model)
    if engine is None:
        raise EngineUnavailableError(f"the model {model} is not loaded now")
    return ModelTarget(model, engine)
