"""The workbench's client of the engine this process runs: the embedded case, with no socket in between."""

from __future__ import annotations

from engine.runtime.engine_thread.engine_ops import engine_op
from engine.runtime.tiers.agents import Tier

from .agent_target import model_target
from .backend import WorkbenchBackend
from .workbench_client import AgentAction, EventSource, Forked, ModelsView, WorkbenchState

# Each action as the engine op it runs and that op's arguments after the agent id.
ENGINE_OPS = {
    AgentAction.EVICT: ("evict_agent", (Tier.WARM,)),
    AgentAction.DROP: ("evict_agent", (Tier.COLD,)),
    AgentAction.PIN: ("pin_agent", (True,)),
    AgentAction.UNPIN: ("pin_agent", (False,)),
    AgentAction.DELETE: ("delete_agent", ()),
}


class LocalClient:
    embedded = True

    def __init__(self, backend: WorkbenchBackend) -> None:
        self.backend = backend

    @property
    def address(self) -> str | None:
        return self.backend.listener.url if self.backend.listener is not None else None

    @property
    def events(self) -> EventSource:
        return self.backend.events

    def start(self) -> None:
        """Nothing to follow: the backend's worker loads the engine and the state reads it directly."""

    def state(self) -> WorkbenchState:
        service = self.backend.service
        swapper = service.swapper
        swap_phase = swapper.status.phase.value if swapper is not None and swapper.status.running else None
        models, extra = None, {}
        if service.models is not None:
            models = ModelsView(tuple(service.models.describe()), service.models.budget(),
                                service.models.routes.default.alias)
            extra = {alias: snap for alias, engine in service.served_engines()[1:]
                     if (snap := engine.snapshot()) is not None}
        return WorkbenchState(service.snapshot(), extra, models, service.stalled_for(), swap_phase)

    async def agent_action(self, model: str | None, agent_id: str, action: AgentAction) -> None:
        op, args = ENGINE_OPS[action]
        await model_target(self.backend.service, model).call(self.backend.service, engine_op(op, agent_id, *args))

    async def fork(self, model: str | None, agent_id: str, new_id: str, display_name: str) -> Forked:
        service = self.backend.service
        branch = await model_target(service, model).call(
            service, engine_op("fork_agent", agent_id, new_id, None, None, display_name))
        return Forked(branch.agent_id, branch.tokens, branch.shared_tokens)

    async def evict_idle(self, to_disk: bool) -> int:
        return await self.backend.service.call(engine_op("evict_idle", Tier.WARM if to_disk else Tier.COLD))

    async def close(self) -> None:
        await self.backend.stop_http()
