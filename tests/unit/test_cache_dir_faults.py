"""The cache directory misbehaving under a running engine (tiny models):
a full disk during eviction, the whole directory removed, a writer bug; and
the directory's permissions (user-only, 0700, with every private subfolder).

Whatever the disk does, the engine keeps serving: an eviction that cannot
be written drops the agent to cold with the reason in the event log, and a
restore whose file vanished prefills the prompt again.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Iterator

import pytest

from engine.store.conversations import ConversationStore
from engine.logging_setup import configure_logging
from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from engine.domain.event_log import EventKind
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store import atomic_text, warm_store
from engine.store.cache_file import writer as cache_writer
from engine.store.cache_file import cache_file_path, quarantine
from engine.store.cold_index import ColdEntry, ColdIndex
from engine.store.private_dirs import make_private_dir, prepare_cache_root
from tests.support.byte_tokenizer import EOS
from tests.support.reference import reference_greedy
from tests.unit.test_cache_file import DiskFullAfter
from tests.unit.test_engine_batching import prompt_for, without_eos
from tests.unit.test_warm_tier import continue_turn, engine_with_store, events_of
from tests.support.tmpfs import tmpfs


def evict_to_warm(engine: Engine, agent_id: str) -> None:
    """Evict and wait until the write settled (written, or failed and the agent cold).

    Timeouts, because a regression here kills the engine thread, and a call
    to a dead engine would wait forever.
    """
    engine.call(lambda e: e.ops.evict_agent(agent_id, Tier.WARM)).result(10)
    engine.call(lambda e: e._store.flush()).result(10)
    engine.call(lambda e: e.tiers.poll()).result(10)


def assert_serves_correctly(engine: Engine, agent_id: str, i: int = 5) -> None:
    result = run_turn(engine, GenerationRequest(agent_id, prompt_for(i), 6))
    assert result.finish.error is None
    expected = reference_greedy(engine.loaded.model, list(result.request.prompt_tokens), 6, {EOS})
    assert result.tokens == without_eos(expected)


def pool_used(engine: Engine) -> int:
    return engine.fresh_snapshot().pool.used_blocks


# -- a full disk ----------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, 4096])
def test_disk_full_during_eviction_drops_the_agent_to_cold_and_the_engine_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    engine = engine_with_store(tmp_path)
    try:
        first = run_turn(engine, GenerationRequest("full", prompt_for(0, 4), 6))
        monkeypatch.setattr(cache_writer, "_open_exclusive", lambda path: DiskFullAfter(path, budget))
        evict_to_warm(engine, "full")
        agent = engine.fresh_snapshot().agent("full")
        assert agent.tier == "cold" and agent.blocks == 0 and pool_used(engine) == 0
        assert any("could not write warm cache" in m and "No space left on device" in m
                   for m in events_of(engine, EventKind.DISCARD))
        engine.call(lambda e: e._store.flush()).result()  # the cold index save queued behind the failure
        directory = engine.call(lambda e: e._store.directory).result()
        assert [p.name for p in directory.iterdir() if p.name.endswith(".tmp")] == []
        assert_serves_correctly(engine, "other")
        again = continue_turn(engine, "full", first, b" more", 6)
        assert again.finish.error is None and again.finish.usage.reused_tokens == 0
    finally:
        engine.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tmpfs mounts are a Linux feature")
def test_a_really_full_disk_during_eviction_keeps_the_engine_serving(tmp_path: Path) -> None:
    disk = tmp_path / "small-disk"
    with tmpfs(disk, "16k"):  # a tiny-llama cache of this prompt is ~60 KiB
        engine = engine_with_store(disk)
        try:
            run_turn(engine, GenerationRequest("big", prompt_for(0, 6), 6))
            evict_to_warm(engine, "big")
            assert engine.fresh_snapshot().agent("big").tier == "cold"
            assert any("No space left on device" in m for m in events_of(engine, EventKind.DISCARD))
            assert_serves_correctly(engine, "after")
        finally:
            engine.stop()


def test_an_unexpected_writer_error_is_a_cold_agent_not_a_dead_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def buggy_writer(directory: Path, record: object) -> None:
        raise ValueError("refusing to write a cache that would not read back")

    engine = engine_with_store(tmp_path)
    try:
        run_turn(engine, GenerationRequest("v", prompt_for(1), 6))
        monkeypatch.setattr(warm_store, "write_cache_file", buggy_writer)
        evict_to_warm(engine, "v")
        assert engine.is_running and engine.fresh_snapshot().agent("v").tier == "cold"
        assert any("would not read back" in m for m in events_of(engine, EventKind.DISCARD))
        assert_serves_correctly(engine, "w")
    finally:
        engine.stop()


# -- the directory removed under the engine -------------------------------------------------------


def test_cache_directory_removed_while_running(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    engine = engine_with_store(root / "agents")
    try:
        gone = run_turn(engine, GenerationRequest("gone", prompt_for(0, 3), 6))
        run_turn(engine, GenerationRequest("later", prompt_for(1, 3), 6))
        evict_to_warm(engine, "gone")
        assert engine.fresh_snapshot().agent("gone").tier == "warm"

        shutil.rmtree(root)  # rm -rf of the whole cache directory mid-run
        assert_serves_correctly(engine, "meanwhile")

        # The next eviction recreates the directory, private again.
        evict_to_warm(engine, "later")
        directory = engine.call(lambda e: e._store.directory).result()
        assert engine.fresh_snapshot().agent("later").tier == "warm"
        assert cache_file_path(directory, "later").is_file()
        for folder in (root, root / "agents", directory):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder

        # A restore whose file vanished prefills again, with the same tokens as a fresh agent.
        resumed = continue_turn(engine, "gone", gone, b" and on", 6)
        assert resumed.finish.error is None and resumed.finish.usage.reused_tokens == 0
        expected = reference_greedy(engine.loaded.model, list(resumed.request.prompt_tokens), 6, {EOS})
        assert resumed.tokens == without_eos(expected)
        assert any("gone" in m and "warm cache unusable, prefilling" in m for m in events_of(engine, EventKind.DISCARD))
        assert engine.is_running
    finally:
        engine.stop()


# -- permissions ----------------------------------------------------------------------------------


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The usual 022, so a plain mkdir would make 0755 folders and a regression shows."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:], root.level = handlers, level


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def fill_cache_dir(root: Path) -> Path:
    """Make every private folder of a cache directory the way semantic does; returns the warm directory."""
    engine = engine_with_store(root / "agents")
    try:
        run_turn(engine, GenerationRequest("p", prompt_for(0), 4))
        evict_to_warm(engine, "p")
        engine.call(lambda e: e.ops.evict_agent("p", Tier.COLD)).result()  # writes cold.json
        directory = engine.call(lambda e: e._store.directory).result()
    finally:
        engine.stop()
    bad = directory / "bad.safetensors"
    bad.write_bytes(b"junk")
    quarantine(bad, "test")
    ConversationStore(root / "conversations").create("agent-1", "be brief", None)
    configure_logging(file=root / "logs" / "workbench.log")
    return directory


PRIVATE = ("", "agents", "conversations", "logs")


def test_a_new_cache_directory_and_its_subfolders_are_user_only(
    tmp_path: Path, loose_umask: None, restore_logging: None
) -> None:
    root = tmp_path / "fresh" / "semantic"
    directory = fill_cache_dir(root)
    for folder in [*(root / name for name in PRIVATE), directory, directory / "quarantine"]:
        assert folder.is_dir() and mode(folder) == 0o700, (folder, oct(mode(folder)))
    assert (directory / "cold.json").is_file() and list((directory / "quarantine").iterdir())
    assert list((root / "conversations").iterdir()) and (root / "logs" / "workbench.log").is_file()


def test_existing_open_subfolders_are_tightened_and_an_open_root_is_reported(
    tmp_path: Path, loose_umask: None, restore_logging: None, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "semantic"
    for name in (*PRIVATE, "models"):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name).chmod(0o755)
    # The root may be a folder the user shares on purpose: reported, left as it is.
    caplog.set_level(logging.WARNING, logger="semantic.store")
    prepare_cache_root(root)
    assert any("open to other users" in r.getMessage() and str(root) in r.getMessage() for r in caplog.records)
    directory = fill_cache_dir(root)
    for folder in [*(root / name for name in PRIVATE[1:]), directory, directory / "quarantine"]:
        assert mode(folder) == 0o700, folder
    assert mode(root) == 0o755 and mode(root / "models") == 0o755  # imported models stay readable


def test_a_missing_cache_root_is_created_user_only(tmp_path: Path, loose_umask: None) -> None:
    root = tmp_path / "a" / "b" / "semantic"
    prepare_cache_root(root)
    assert [mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", root)] == [0o700] * 3


def test_a_file_in_the_way_of_a_private_folder_is_an_os_error(tmp_path: Path) -> None:
    (tmp_path / "agents").write_text("not a folder")
    with pytest.raises(OSError):
        make_private_dir(tmp_path / "agents" / "model")
    with pytest.raises(OSError):
        make_private_dir(tmp_path / "agents")


def test_a_cold_index_that_cannot_be_saved_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    index = ColdIndex(tmp_path / "model" / "cold.json")
    index.add(ColdEntry("a", 10, 1.0))
    index.save()
    saved = index.path.read_text()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic_text.os, "fsync", full)
    index.add(ColdEntry("b", 20, 2.0))
    index.save()
    assert sorted(p.name for p in index.path.parent.iterdir()) == ["cold.json"]
    assert index.path.read_text() == saved
    assert any("No space left on device" in r.getMessage() for r in caplog.records)
