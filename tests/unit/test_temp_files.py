"""The start-up sweep of temporary files: a dead writer's go, a live writer's stay, finished files are never
touched; and every writer names its temporary files so the sweep can tell."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from engine.store import temp_files
from engine.store.atomic_text import write_text_atomically
from engine.store.temp_files import TEMP_NAME, sweep_dead_temps, temp_prefix

pytestmark = pytest.mark.unit


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def touch(path: Path, age_s: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


def test_dead_and_own_writers_files_go_live_ones_and_finished_files_stay(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(temp_files, "_swept", set())
    dead, live, me = dead_pid(), os.getppid(), os.getpid()
    gone = [touch(tmp_path / f"conversations/.a.json.{dead}.k2j4_x9q.tmp"),
            touch(tmp_path / f".export.{dead}.abcd1234.safetensors"),
            touch(tmp_path / f"agents/m/.agent-1f.{me}.0a1b2c3d.tmp"),  # a container's server: the same pid again
            touch(tmp_path / f"agents/m/.cold.json.{live}.zzzzzzzz.tmp", age_s=2 * temp_files.STALE_S)]
    kept = [touch(tmp_path / f"responses/.r.json.{live}.abcdefgh.tmp"),  # another live server is writing it
            touch(tmp_path / "agents/m/agent-1f.safetensors"), touch(tmp_path / "conversations/a.json"),
            touch(tmp_path / f"models/x/.part.{dead}.abcdefgh.tmp")]  # imported models: the importer's business
    assert sorted(sweep_dead_temps(tmp_path)) == sorted(gone)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in gone)
    # A second sweep in the same process (a model reloaded) keeps this process's own files: they are live now.
    mine = touch(tmp_path / f"conversations/.b.json.{me}.abcdefgh.tmp")
    assert sweep_dead_temps(tmp_path) == [] and mine.exists()


def test_every_writer_names_its_temp_files_for_the_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        seen.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_text_atomically(tmp_path / "conversations" / "agent-1f.json", "{}")
    assert TEMP_NAME.fullmatch(seen[0]) and f".{os.getpid()}." in seen[0]
    fd, name = tempfile.mkstemp(prefix=temp_prefix("export"), suffix=".safetensors", dir=tmp_path)
    os.close(fd)
    assert TEMP_NAME.fullmatch(Path(name).name)
    from engine.store.cache_file.format import TEMP_NAME as CACHE_TEMP_NAME

    writer = f".agent-1f.{os.getpid()}.{'0a1b2c3d'}.tmp"  # the cache writer's own naming (cache_file/writer.py)
    assert TEMP_NAME.fullmatch(writer) and CACHE_TEMP_NAME.fullmatch(writer)


def test_a_text_file_is_synced_then_its_directory_after_the_rename(tmp_path: Path, monkeypatch) -> None:
    """So a power cut after the write keeps the new name: the file's data first, the directory's entry after."""
    import os
    import stat

    from engine.store import atomic_text

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(atomic_text.os, "fsync", fsync)
    atomic_text.write_text_atomically(tmp_path / "conversation.json", "{}")
    assert synced == ["file", "dir"]
    assert (tmp_path / "conversation.json").read_text() == "{}"
