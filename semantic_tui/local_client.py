"""The workbench's client of the engine this process runs: the embedded case, with no socket in between."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

from engine.errors import SemanticError
from engine.store.agent_export import export_agent, import_agent
from engine.store.agents_on_disk import ModelKey
from engine.store.cache_file import read_header
from engine.models.registry import RegistryEntry
from engine.runtime.engine_thread.engine_ops import (AdoptAgent, CheckImport, DeleteAgent, EngineOp, EvictAgent, EvictIdle,
                                                     ForkAgent, PauseAgent, PinAgent, RewindAgent, SetAgentPriority,
                                                     WriteAgent)
from engine.runtime.tiers.agents import Tier

from .agent_target import ModelTarget, model_target
from .backend import WorkbenchBackend
from .chat_link import LocalChatLink
from .workbench_client import (AgentAction, EventSource, Forked, ModelsView, SwapWatch, Transferred,
                               WorkbenchState)

# Each action as the engine op it runs on the agent.
ENGINE_OPS: dict[AgentAction, Callable[[str], EngineOp]] = {
    AgentAction.EVICT: lambda agent_id: EvictAgent(agent_id, Tier.WARM),
    AgentAction.DROP: lambda agent_id: EvictAgent(agent_id, Tier.COLD),
    AgentAction.PIN: lambda agent_id: PinAgent(agent_id, True),
    AgentAction.UNPIN: lambda agent_id: PinAgent(agent_id, False),
    AgentAction.DELETE: DeleteAgent,
}


class LocalClient:
    embedded = True

    def __init__(self, backend: WorkbenchBackend) -> None:
        self.backend = backend
        self.chat = LocalChatLink(backend.service)

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
        await model_target(self.backend.service, model).call(self.backend.service, ENGINE_OPS[action](agent_id))

    async def steer(self, model: str | None, agent_id: str, priority: int | None = None,
                    paused: bool | None = None) -> None:
        target = model_target(self.backend.service, model)
        if priority is not None:
            await target.call(self.backend.service, SetAgentPriority(agent_id, priority))
        if paused is not None:
            await target.call(self.backend.service, PauseAgent(agent_id, paused))

    async def fork(self, model: str | None, agent_id: str, new_id: str, display_name: str) -> Forked:
        service = self.backend.service
        branch = await model_target(service, model).call(
            service, ForkAgent(agent_id, new_id, display_name=display_name))
        return Forked(branch.agent_id, branch.tokens, branch.shared_tokens)

    async def rewind(self, model: str | None, agent_id: str, turn: int) -> int:
        service = self.backend.service
        branch = await model_target(service, model).call(service, RewindAgent(agent_id, turn))
        return branch.tokens

    async def export_agent(self, model: str | None, agent_id: str, path: Path) -> Transferred:
        service = self.backend.service
        target = model_target(service, model)
        write = await target.call(service, WriteAgent(agent_id))
        if write is not None:
            await asyncio.wrap_future(write)  # the store's I/O thread writes the warm file first
        key = model_key(target.running_engine(service).loaded)
        summary = await asyncio.to_thread(export_agent, service.settings.cache_dir, agent_id, path, key)
        return Transferred(agent_id, summary.n_tokens, summary.nbytes, summary.path, model)

    async def import_agent(self, path: Path) -> Transferred:
        """Into the serving model whose weights made the file (the default model when none did: its check
        then says which model the file wants)."""
        service = self.backend.service
        header = await asyncio.to_thread(read_header, path)
        alias, engine = service.import_target(ModelKey.of_header(header))
        target = ModelTarget(None if engine is service.engine else alias, engine)
        await target.call(service, CheckImport(header.agent_id, False))
        summary = await asyncio.to_thread(import_agent, service.settings.cache_dir, path, None,
                                          model_key(engine.loaded))
        await target.call(service, AdoptAgent(summary.path))
        return Transferred(summary.agent_id, summary.n_tokens, summary.nbytes, None, target.model)

    async def swap_choices(self) -> list[RegistryEntry]:
        service = self.backend.service
        if service.swapper is None:
            shard = service.engine.loaded.shard if service.is_ready else None
            if shard is not None:
                raise SemanticError(f"model swaps are not available while the model is sharded across {shard[1]} "
                                    "ranks: restart the ranks with the other model")
            raise SemanticError("model swaps start once the first model has loaded")
        return await asyncio.to_thread(service.registry.entries)  # may read the models folder

    async def start_swap(self, entry: RegistryEntry) -> SwapWatch:
        swapper = self.backend.service.swapper
        if swapper is None:
            raise SemanticError("model swaps start once the first model has loaded")
        swapper.request(entry.location, self.backend.settings.swap_grace_s)
        return swapper

    async def evict_idle(self, to_disk: bool) -> int:
        return await self.backend.service.call(EvictIdle(Tier.WARM if to_disk else Tier.COLD))

    async def close(self) -> None:
        await self.backend.stop_http()


def model_key(loaded: Any) -> ModelKey:
    """The model and cache layout an agent file is tied to."""
    return ModelKey.of_model(loaded.identity, loaded.spec)
