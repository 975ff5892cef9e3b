"""The command palette (ctrl+p): every action as an ``area: verb`` command.

Commands depend on state (the selected agent, whether it is pinned, which
themes exist), so they come from a Provider asked afresh on every search.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

from .workbench_host import WorkbenchHost

Command = tuple[str, str, Callable[[], object]]

# (command, whether it acts on the selected agent, help, the app's action it runs)
ACTIONS: tuple[tuple[str, bool, str, str], ...] = (
    ("agent: open chat", True, "Open a chat pane bound to the selected agent", "open_chat"),
    ("agent: evict to disk", True, "Move the agent's KV cache from the pool to the warm tier", "evict_warm"),
    ("agent: drop", True, "Drop the agent's cache entirely (cold); the next turn prefills", "drop"),
    ("agent: cache history", True, "How the agent's last turns met its cache: reused, diverged where and why",
     "cache_history"),
    ("agent: fork", True, "A new agent sharing this one's cache by reference; opens a chat on it", "fork"),
    ("agent: rewind", True, "Take the agent back to the end of an earlier turn (pick one)", "rewind"),
    ("agent: export to a file", True, "One file: cache blocks, tokens, conversation, model identity",
     "export_agent"),
    ("agent: import from a file", False, "Install an exported agent as a warm agent of this model", "import_agent"),
    ("agent: pin / unpin", True, "Pinned agents are never evicted", "toggle_pin"),
    ("agent: delete", True, "Forget the agent: pool blocks, disk files and metadata", "delete_agent"),
    ("chat: new", False, "Open a chat pane on a new agent", "new_chat"),
    ("chat: close", False, "Close the focused chat pane", "close_chat"),
    ("chat: next pane", False, "Focus the next chat pane", "next_pane"),
    ("pool: evict all idle", False, "Move every idle, unpinned agent to the warm tier", "evict_idle"),
    ("pool: drop all idle", False, "Drop every idle, unpinned agent's cache (cold)", "drop_idle"),
    ("view: toggle log / chats", False, "Switch the bottom area between the event log and the chats",
     "toggle_bottom"),
    ("view: zoom focused pane", False, "Maximize the focused pane (esc to restore)", "zoom"),
    ("view: taller bottom area", False, "Give the chats/log more rows", "grow_bottom"),
    ("view: shorter bottom area", False, "Give the dashboard more rows", "shrink_bottom"),
    ("app: copy API address", False, "Copy the HTTP address for ANTHROPIC_BASE_URL", "copy_address"),
    ("app: quit", False, "Persist agent caches and quit", "quit"),
)


class WorkbenchCommands(Provider):
    @property
    def workbench(self) -> WorkbenchHost:
        return cast(WorkbenchHost, self.app)

    def _commands(self) -> list[Command]:
        app = self.workbench
        agent = app.selected_agent_label()
        target = f" ({agent})" if agent else " (select an agent in the table)"
        commands: list[Command] = [(label + (target if on_agent else ""), help_text, partial(app.run_action, action))
                                   for label, on_agent, help_text, action in ACTIONS]
        for theme in app.theme_choices():
            commands.append((f"view: theme {theme}", f"Switch to the {theme} theme (remembered)", partial(app.set_theme, theme)))
        commands += app.model_commands()
        return commands

    async def discover(self) -> Hits:
        for name, help_text, callback in self._commands():
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, callback in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text)
