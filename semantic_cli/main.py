"""The `semantic` command: the workbench, headless serving, and model utilities.

    semantic                      the workbench (TUI) with the HTTP API inside
    semantic --serve              the same engine and API, headless
    semantic attach [URL]         the workbench on a running server (quitting leaves the server running)
    semantic launch claude|codex  Claude Code or Codex CLI against semantic (`-- ARGS` go to the client)
    semantic models [FOLDER...]   packaged and imported models, and how their layers are cached
    semantic import MODEL         import a packaged model or .gguf file now
    semantic generate PROMPT      one turn through the engine, streamed to stdout
    semantic agents list          agents on disk; `agents export` / `agents import` move one as a file
    semantic doctor               the backend, the BLAS under MLX's matmul and its measured rate
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from engine.errors import SemanticError
from engine.settings import Settings, load_settings
from engine.store.private_dirs import prepare_cache_root

from semantic_cli.agents import add_agents_command
from semantic_cli.attach import add_attach_command
from semantic_cli.launch import add_launch_command, split_client_args
from semantic_cli.args import overrides_from, settings_parser

log = logging.getLogger("semantic.cli")


def build_parser() -> argparse.ArgumentParser:
    shared = settings_parser()
    parser = argparse.ArgumentParser(
        prog="semantic",
        description="A terminal workbench for many local LLM agents on MLX: per-agent KV caches, "
        "a disk tier, continuous batching, Anthropic and OpenAI compatible APIs.",
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[shared],
    )
    parser.add_argument("--serve", action="store_true", help="run headless: engine and HTTP API, structured logs")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    models = commands.add_parser("models", parents=[shared], help="list packaged and imported models, with how "
                                 "each one's layers are cached (or why one cannot be served)")
    models.add_argument("folders", nargs="*", type=Path, metavar="FOLDER",
                        help="also show these MLX model folders' layer groups (no weights are loaded)")
    imp = commands.add_parser("import", parents=[shared], help="import a packaged model or a .gguf file now")
    imp.add_argument("target", nargs="?", help="alias or .gguf path (default: the configured model)")
    gen = commands.add_parser("generate", parents=[shared], help="run one turn through the engine")
    gen.add_argument("prompt", help="the user message")
    gen.add_argument("--agent", default="cli", help="agent id whose cache to use (default: cli)")
    gen.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (default: 256)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    commands.add_parser("doctor", parents=[shared], help="check the compute backend, the BLAS under MLX's matmul "
                        "and its measured rate; prints the command that fixes a slow BLAS (exit 1 while it stands)")
    add_agents_command(commands, shared)
    add_attach_command(commands)
    add_launch_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    entry_point = argv is None
    argv = sys.argv[1:] if argv is None else argv
    argv, client_args = split_client_args(argv)
    args = build_parser().parse_args(argv)
    args.client_args = client_args
    try:
        settings = load_settings(**overrides_from(args))
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        print(f"semantic: invalid settings: {exc}", file=sys.stderr)
        return 2
    from engine.logging_setup import configure_logging

    # The workbench draws on the terminal: its logs go to a file (the log pane shows engine events).
    workbench = args.command == "attach" or (args.command is None and not args.serve and not _headless_rank())
    log_file = settings.cache_dir / "logs" / "workbench.log" if workbench else None
    configure_logging(settings.log_level, json_lines=settings.log_json or (args.serve and not sys.stderr.isatty()),
                      file=log_file)
    if entry_point and args.command not in ("attach", "launch"):  # an attached workbench or a client runs no MLX
        _maybe_reexec(settings)
    prepare_cache_root(settings.cache_dir)
    try:
        return _dispatch(args, settings)
    except SemanticError as exc:
        print(f"semantic: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _headless_rank() -> bool:
    """A rank of a sharded model that cannot draw the workbench: not rank 0, or no terminal (mlx.launch
    pipes output). It runs headless and logs to stderr, where the launcher shows each rank's lines."""
    from engine.distributed.world import launched_distributed

    if not launched_distributed():
        return False
    return os.environ.get("MLX_RANK", "0") != "0" or not sys.stdout.isatty()


def _maybe_reexec(settings: Settings) -> None:
    """Restart once with OpenBLAS preloaded on Linux CPU (logs the restart in the new process); warn while MLX
    runs on its slow bundled BLAS, with the command that fixes it."""
    from engine.platform import install_command, maybe_reexec_with_openblas, slow_blas

    warned: list[str] = []

    def warn(message: str) -> None:
        warned.append(message)
        log.warning(message)

    maybe_reexec_with_openblas(sys.argv, settings.preload_openblas, log.info, warn)
    if not warned and slow_blas():  # the preload is off, or it did not load
        log.warning("slow BLAS: MLX's CPU matmul runs on its bundled reference BLAS (about 30x slower); "
                    f"{install_command()}, or see `semantic doctor`")


def _dispatch(args: argparse.Namespace, settings: Settings) -> int:
    from semantic_cli import commands

    if args.command == "models":
        return commands.list_models(settings, args.folders)
    if args.command == "import":
        return commands.import_model(settings, args.target)
    if args.command == "generate":
        return commands.generate(settings, args)
    if args.command == "doctor":
        from semantic_cli.doctor import doctor

        return doctor(settings)
    if args.command == "attach":
        from semantic_cli.attach import attach

        return attach(settings, args)
    if args.command == "launch":
        from semantic_cli.launch import launch

        return launch(settings, args)
    if args.command == "agents":
        from semantic_cli.agents import run_agents

        return run_agents(settings, args)
    if args.serve:
        return commands.serve(settings)
    return commands.workbench(settings)


if __name__ == "__main__":
    raise SystemExit(main())
