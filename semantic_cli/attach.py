"""``semantic attach [URL]``: the workbench as a client of a server that is already running.

The server is whatever serves semantic's API: ``semantic --serve`` under
systemd or launchd, in a tmux pane, on another machine, or another workbench's
listener. Quitting the attached workbench leaves that server running.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from engine.settings import Settings

DEFAULT_INTERVAL_S = 0.5


def add_attach_command(commands: Any) -> None:
    attach = commands.add_parser(
        "attach", help="open the workbench on a running server (semantic --serve, or another workbench)",
        description="Open the workbench on a server that is already running: every pane live from its "
        "/v1/stream, every control through its API (chat, new, evict, drop, pin, delete, fork, rewind, export "
        "and import to files on this machine, evict idle, model swap). Chats are direct-API agents of the "
        "server, which keeps their conversations; another client's turns show in the log, not token by token. "
        "Quitting never stops the server; when the server restarts the workbench reconnects.")
    attach.add_argument("url", nargs="?", metavar="URL",
                        help="the server's address, e.g. http://127.0.0.1:8642 (default: the server recorded in "
                        "the cache dir's listener.json while it runs, else --host and --port's defaults)")
    attach.add_argument("--api-key", dest="api_key", default=argparse.SUPPRESS, metavar="KEY",
                        help="the server's API key, if it has one [env SEMANTIC_API_KEY]")
    attach.add_argument("--cache-dir", dest="cache_dir", type=Path, default=argparse.SUPPRESS, metavar="PATH",
                        help="the cache dir whose running server to find when no URL is given "
                        "[env SEMANTIC_CACHE_DIR]")
    attach.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                        help=f"seconds between the server's snapshots (0.1-10; default {DEFAULT_INTERVAL_S})")


def server_address(settings: Settings, url: str | None) -> str:
    """The URL given, else the running server recorded in the cache dir, else the configured host and port."""
    from engine.api.listener_file import recorded_listener

    if url:
        return url if "://" in url else f"http://{url}"
    recorded = recorded_listener(settings.cache_dir)
    if recorded is not None:
        return recorded
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"


def attach(settings: Settings, args: argparse.Namespace) -> int:
    from semantic_tui.app import SemanticApp
    from semantic_tui.preferences import load_preferences
    from semantic_tui.remote_client import RemoteClient

    if not 0.1 <= args.interval <= 10:
        print(f"semantic attach: --interval must be between 0.1 and 10 seconds, not {args.interval}")
        return 2
    key = settings.api_key.get_secret_value() if settings.api_key else None
    client = RemoteClient(server_address(settings, args.url), api_key=key, interval_s=args.interval)
    SemanticApp(client, load_preferences()).run()
    return 0
