"""The command palette (ctrl+p): every action as an ``area: verb`` command.

Commands depend on state (the selected agent, whether it is pinned, which
themes exist), so they come from a Provider asked afresh on every search.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

from textual.command import DiscoveryHit, Hit, Hits, Provider

if TYPE_CHECKING:
    from .app import SemanticApp

Command = tuple[str, str, Callable[[], object]]


class WorkbenchCommands(Provider):
    @property
    def workbench(self) -> "SemanticApp":
        return self.app  # type: ignore[return-value]

    def _commands(self) -> list[Command]:
        app = self.workbench
        agent = app.selected_agent_label()
        target = f" ({agent})" if agent else " (select an agent in the table)"
        commands: list[Command] = [
            ("agent: open chat" + target, "Open a chat pane bound to the selected agent", app.action_open_chat),
            ("agent: evict to disk" + target, "Move the agent's KV cache from the pool to the warm tier", app.action_evict_warm),
            ("agent: drop" + target, "Drop the agent's cache entirely (cold); the next turn prefills", app.action_drop),
            ("agent: cache history" + target, "How the agent's last turns met its cache: reused, diverged "
             "where and why", app.action_cache_history),
            ("agent: fork" + target, "A new agent sharing this one's cache by reference; opens a chat on it",
             app.action_fork),
            ("agent: rewind" + target, "Take the agent back to the end of an earlier turn (pick one)",
             app.action_rewind),
            ("agent: export to a file" + target, "One file: cache blocks, tokens, conversation, model identity",
             app.action_export_agent),
            ("agent: import from a file", "Install an exported agent as a warm agent of this model",
             app.action_import_agent),
            ("agent: pin / unpin" + target, "Pinned agents are never evicted", app.action_toggle_pin),
            ("agent: delete" + target, "Forget the agent: pool blocks, disk files and metadata", app.action_delete_agent),
            ("chat: new", "Open a chat pane on a new agent", app.action_new_chat),
            ("chat: close", "Close the focused chat pane", app.action_close_chat),
            ("chat: next pane", "Focus the next chat pane", app.action_next_pane),
            ("pool: evict all idle", "Move every idle, unpinned agent to the warm tier", app.action_evict_idle),
            ("pool: drop all idle", "Drop every idle, unpinned agent's cache (cold)", app.action_drop_idle),
            ("view: toggle log / chats", "Switch the bottom area between the event log and the chats", app.action_toggle_bottom),
            ("view: zoom focused pane", "Maximize the focused pane (esc to restore)", app.action_zoom),
            ("view: taller bottom area", "Give the chats/log more rows", app.action_grow_bottom),
            ("view: shorter bottom area", "Give the dashboard more rows", app.action_shrink_bottom),
            ("app: copy API address", "Copy the HTTP address for ANTHROPIC_BASE_URL", app.action_copy_address),
            ("app: quit", "Persist agent caches and quit", app.action_quit),
        ]
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
