"""What the empty Agents pane says: how to start an agent, with the exact command lines for this server."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static


class AgentsHint(Static):
    """Shown while the engine knows no agent; hidden from the first one on."""

    DEFAULT_CSS = """
    AgentsHint { height: auto; max-height: 50%; padding: 0 1; color: $text-muted; }
    """
    url: reactive[str | None] = reactive(None)

    def render(self) -> Text:
        url = self.url or "http://127.0.0.1:8642"
        text = Text()
        text.append("No agents yet. ", style="bold")
        text.append("Press ")
        text.append("n", style="bold")
        text.append(f" for a chat, or point a client at {url}:\n")
        text.append("Claude Code ", style="bold")
        text.append(f"ANTHROPIC_BASE_URL={url} ANTHROPIC_API_KEY=local claude\n")
        text.append("Codex CLI ", style="bold")
        text.append(f'base_url = "{url}/v1", wire_api = "responses" in ~/.codex/config.toml (README), then codex\n')
        text.append("OpenAI SDK ", style="bold")
        text.append(f'OpenAI(base_url="{url}/v1", api_key="local")')
        return text
