"""`semantic agents`: list, export and import agents in the cache directory, no server needed.

These commands read and write files only, so they run while no server does
(or beside one: a running server picks up an imported agent at its next start).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engine.errors import AgentExistsError
from engine.settings import Settings
from engine.store.agent_export import ExportSummary, ImportSummary, export_agent, import_agent
from engine.store.agents_on_disk import AgentOnDisk, agents_root, list_agents

from semantic_cli.args import settings_parser
from semantic_tui.formatting import human_bytes

_DESCRIPTION = """\
Agents on disk under the cache directory (--cache-dir): each one's KV cache
(per model), and its conversation when it talks through /v1/agents. No server
is needed; a running one sees an imported agent after its next start.

  semantic agents list                      every agent on disk
  semantic agents export ID FILE            one agent as one self-contained file
  semantic agents import FILE [--as NEW]    that file, as a warm agent here
"""


def add_agents_command(commands: Any, shared: argparse.ArgumentParser) -> None:
    """Register ``agents list|export|import`` under the CLI's subcommands."""
    agents = commands.add_parser(
        "agents", parents=[shared], help="list, export and import agents on disk (no server needed)",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = agents.add_subparsers(dest="agents_action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", parents=[shared], help="every agent on disk, per model",
                                 description="Every agent in the cache directory: its id, tier (warm: its "
                                 "cache is on disk; cold: listed, cache dropped; none: a conversation that "
                                 "never ran), model folder, cached tokens, file size, conversation turns "
                                 "and when it was last written.")
    listing.add_argument("--json", action="store_true", help="print one JSON object per agent, for scripts")
    _add_export(actions)
    _add_import(actions, shared)


def _add_export(actions: Any) -> None:
    # This command's --model picks a model folder; the shared --model (which
    # model a server loads) means nothing to a command that loads none.
    export = actions.add_parser(
        "export", parents=[settings_parser(without=frozenset({"model"}))], help="write one agent to one file",
        description="Write an agent's KV cache (every block, token ids, checkpoints, the model and cache "
        "layout that made it) and its conversation to one checksummed file that stands alone: blocks it "
        "shares with other agents are copied in. Import it with `semantic agents import`.",
    )
    export.add_argument("agent_id", metavar="ID", help="the agent's id, as `semantic agents list` shows it")
    export.add_argument("file", metavar="FILE", type=Path,
                        help="the file to write, e.g. planner.safetensors (an existing file is replaced)")
    export.add_argument("--model", "-m", dest="model_key", metavar="KEY",
                        help="when several models hold a cache of the agent, the one to export: its model "
                        "folder (the MODEL FOLDER column of `semantic agents list`), model name, or "
                        "name@digest (default: the most recently used)")


def _add_import(actions: Any, shared: argparse.ArgumentParser) -> None:
    imp = actions.add_parser(
        "import", parents=[shared], help="install an exported agent here, warm",
        description="Check an exported file (checksum, header, tensor shapes) and install the agent in the "
        "cache directory under the model that made it, with its conversation, so its next turn resumes "
        "from the cache. Refuses a damaged file, one made with another cache layout than the agents "
        "already cached for that model, and an id that exists (unless --replace).",
    )
    imp.add_argument("file", metavar="FILE", type=Path, help="a file written by `semantic agents export`")
    imp.add_argument("--as", dest="new_id", metavar="NEW_ID",
                     help="install under this id instead of the exported one (letters, digits, . _ : @ + = -)")
    imp.add_argument("--replace", action="store_true",
                     help="overwrite an agent of the same id (its cache, cold entry and conversation)")


def run_agents(settings: Settings, args: argparse.Namespace) -> int:
    if args.agents_action == "list":
        return _list(settings, args.json)
    if args.agents_action == "export":
        summary = export_agent(settings.cache_dir, args.agent_id, args.file, args.model_key)
        print(_exported(summary))
        return 0
    try:
        imported = import_agent(settings.cache_dir, args.file, args.new_id, replace_existing=args.replace)
    except AgentExistsError as exc:
        print(f"semantic: {exc}; pass --replace to overwrite it, or --as NEW_ID", file=sys.stderr)
        return 1
    print(_imported(imported))
    return 0


# -- output -------------------------------------------------------------------------------------
_COLUMNS = ("ID", "TIER", "MODEL FOLDER", "TOKENS", "SIZE", "TURNS", "LAST WRITTEN")


def _list(settings: Settings, as_json: bool) -> int:
    rows = list_agents(settings.cache_dir)
    if as_json:
        for row in rows:
            print(json.dumps({**asdict(row), "tier": row.tier.value}))
        return 0
    if not rows:
        print(f"no agents in {agents_root(settings.cache_dir)}")
        return 0
    cells = [_COLUMNS, *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    for line in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    return 0


def _cells(row: AgentOnDisk) -> tuple[str, ...]:
    written = time.strftime("%Y-%m-%d %H:%M", time.localtime(row.last_written)) if row.last_written else "-"
    return (row.agent_id, row.tier.value, row.model_dir or "-", str(row.n_tokens),
            human_bytes(row.nbytes) if row.nbytes else "-",
            "-" if row.conversation_turns is None else str(row.conversation_turns), written)


def _exported(summary: ExportSummary) -> str:
    lines = [f"exported {summary.agent_id!r} to {summary.path}: {summary.n_tokens} tokens, "
             f"{human_bytes(summary.nbytes)}, model {summary.model}{_turns(summary.conversation_turns)}"]
    if summary.inlined_prefix_tokens:
        lines.append(f"  its {summary.inlined_prefix_tokens}-token shared prefix is copied in")
    if summary.also_in:
        lines.append(f"  it also has caches for {', '.join(summary.also_in)}: this is the most recently "
                     "used; pick another with --model")
    return "\n".join(lines)


def _imported(summary: ImportSummary) -> str:
    verb = "replaced" if summary.replaced else "imported"
    return (f"{verb} {summary.agent_id!r}: {summary.n_tokens} tokens, {human_bytes(summary.nbytes)}, "
            f"model {summary.model}{_turns(summary.conversation_turns)} -> {summary.path}")


def _turns(turns: int | None) -> str:
    return "" if turns is None else f", conversation of {turns} turns"
