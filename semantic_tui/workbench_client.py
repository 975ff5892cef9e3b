"""What the workbench's panes and controls need of an engine, whether it runs in this process or elsewhere.

Two clients stand behind this one interface: :class:`~.local_client.LocalClient`
over the engine this process runs (the embedded workbench), and
:class:`~.remote_client.RemoteClient` over a running server's HTTP API (``semantic
attach``). The app draws every pane from :meth:`WorkbenchClient.state` and sends
every agent control through :meth:`WorkbenchClient.agent_action` and every chat
through its ``chat`` link (chat_link.py), so the two
workbenches cannot drift: a pane or control that works embedded works attached,
because it is the same code reading the same types.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.domain.event_log import LogEvent
from engine.models.registry import RegistryEntry
from engine.runtime.engine_thread.snapshot import AgentView, EngineSnapshot

if TYPE_CHECKING:
    from engine.swap import SwapStatus

    from .chat_link import ChatLink


class AgentAction(str, enum.Enum):
    """The controls a workbench applies to one agent's cache."""

    EVICT = "evict"  # to the warm (disk) tier
    DROP = "drop"  # to the cold tier: the cache is gone, the conversation stays
    PIN = "pin"
    UNPIN = "unpin"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class Forked:
    """What a fork left: the new agent and its cached tokens, how many of them in blocks shared by reference;
    ``conversation``: the server copied a stored conversation into it (a direct-API agent's), so a chat can go
    on from it."""

    agent_id: str
    tokens: int
    shared_tokens: int
    conversation: bool = False


@dataclass(frozen=True, slots=True)
class Transferred:
    """An agent file written (export: ``path`` is the file) or installed (import: ``model`` is the extra model's
    alias it went to, None for the default model)."""

    agent_id: str
    tokens: int
    nbytes: int
    path: Path | None = None
    model: str | None = None


@dataclass(frozen=True, slots=True)
class ModelsView:
    """The resident models (``--extra-model``): ``/v1/stats``'s ``models`` rows and ``models_budget``."""

    rows: tuple[dict[str, Any], ...]
    budget: dict[str, int]
    default_alias: str


@dataclass(frozen=True, slots=True)
class WorkbenchState:
    """One picture of the engine for every pane at once."""

    snapshot: EngineSnapshot | None  # the default model's; None before it first publishes
    # Extra models' snapshots by alias (the side panes show the selected row's model) and their agents' rows.
    extra: dict[str, EngineSnapshot] = field(default_factory=dict)
    models: ModelsView | None = None  # None with one model: the Models panel stays hidden
    stalled_s: float | None = None  # the engine's watchdog: seconds without a step while work waits
    swap_phase: str | None = None  # while a model swap runs
    link: str | None = None  # attached: why the picture is not live ("connecting to …", "reconnecting …")

    @property
    def other_agents(self) -> tuple[tuple[str, AgentView], ...]:
        return tuple((alias, view) for alias, snap in self.extra.items() for view in snap.agents)

    def snapshot_of(self, model: str | None) -> EngineSnapshot | None:
        """The snapshot of ``model`` (an extra model's alias; None: the default model)."""
        return self.snapshot if model is None else self.extra.get(model)


class EventSource(Protocol):
    def since(self, seq: int) -> list[LogEvent]:
        """The engine's events after ``seq``, oldest first."""


class SwapWatch(Protocol):
    """A swap in progress: its status as last known (the progress screen polls it)."""

    @property
    def status(self) -> SwapStatus: ...


class WorkbenchClient(Protocol):
    """The engine as the workbench reaches it. ``state`` and ``events`` never wait on the engine."""

    embedded: bool  # True: this process runs the engine (the workbench loads it, and quitting stops it)
    address: str | None  # the HTTP API's base URL, once known
    events: EventSource
    chat: ChatLink  # how chat panes send turns (and watch other clients' turns)

    def start(self) -> None:
        """Begin following the engine (attached: open the live stream; call on the app's event loop)."""

    def state(self) -> WorkbenchState: ...

    async def agent_action(self, model: str | None, agent_id: str, action: AgentAction) -> None:
        """Apply ``action`` to ``agent_id`` of ``model``; SemanticError (with the server's message) when refused."""

    async def steer(self, model: str | None, agent_id: str, priority: int | None = None,
                    paused: bool | None = None) -> None:
        """Set ``agent_id``'s priority level (0 most urgent .. 9) and/or pause or resume it (None: unchanged);
        SemanticError when refused."""

    async def fork(self, model: str | None, agent_id: str, new_id: str, display_name: str) -> Forked:
        """A new agent ``new_id`` starting from ``agent_id``'s whole cache, sharing its blocks."""

    async def rewind(self, model: str | None, agent_id: str, turn: int) -> int:
        """Cut ``agent_id``'s cache (and a direct agent's conversation) back to the end of ``turn``; the tokens
        its cache holds after."""

    async def export_agent(self, model: str | None, agent_id: str, path: Path) -> Transferred:
        """Write ``agent_id`` as one agent file at ``path`` on this machine (atomically)."""

    async def import_agent(self, path: Path) -> Transferred:
        """Install the agent file at ``path`` (on this machine) into the engine as a warm agent."""

    async def swap_choices(self) -> list[RegistryEntry]:
        """The models a swap may go to (the loaded one marked); SemanticError saying why when swaps are off."""

    async def start_swap(self, entry: RegistryEntry) -> SwapWatch:
        """Start swapping to ``entry``; what to follow its progress by."""

    async def evict_idle(self, to_disk: bool) -> int:
        """Send every idle, unpinned hot agent of the default model to disk (or drop them); how many moved."""

    async def close(self) -> None:
        """Let go of the engine: the embedded one stops (caches persisted), an attached server keeps running."""
