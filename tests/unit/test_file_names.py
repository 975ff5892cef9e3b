"""Agent ids to file name stems: safe for any id, distinct for distinct ids."""

from __future__ import annotations

import os
import re
from pathlib import Path

from hypothesis import given, settings, strategies as st

from engine.store.conversations import ConversationStore
from engine.store.cache_file import cache_file_path
from engine.store.file_names import DIGEST_HEX_CHARS, STEM_MAX_CHARS, agent_file_stem

SAFE_STEM = re.compile(r"[A-Za-z0-9_-]+")
HOSTILE_IDS = [
    "", "../x", "../../etc/passwd", "/etc/passwd", "a\x00b", ".", "..", "-rf", "a/b\\c",
    "x" * 100_000, "\u202eevil\u202c.exe", "مرحبا بالعالم", "🦀🚀",
    "café", "cafe\u0301",
    "CON", "Agent", "agent", "\ud800lone surrogate", " spaces  and\ttabs ",
]


def assert_safe(stem: str) -> None:
    assert SAFE_STEM.fullmatch(stem), stem
    assert len(stem) <= STEM_MAX_CHARS
    assert not stem.startswith("-")


def test_hostile_ids_give_safe_distinct_names() -> None:
    stems = [agent_file_stem(agent_id) for agent_id in HOSTILE_IDS]
    for stem in stems:
        assert_safe(stem)
    assert len(set(stems)) == len(HOSTILE_IDS)
    # Case-insensitive file systems (APFS by default) must still see distinct names.
    assert len({stem.lower() for stem in stems}) == len(HOSTILE_IDS)


def test_readable_ids_keep_a_readable_slug() -> None:
    assert agent_file_stem("planner-1").startswith("planner-1-")
    assert agent_file_stem("café").startswith("cafe-")
    assert agent_file_stem("../x").startswith("x-")
    assert re.fullmatch(f"[0-9a-f]{{{DIGEST_HEX_CHARS}}}", agent_file_stem("🦀"))


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_id_gives_a_safe_deterministic_stem(agent_id: str) -> None:
    stem = agent_file_stem(agent_id)
    assert_safe(stem)
    assert agent_file_stem(agent_id) == stem


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=60), min_size=2, max_size=30, unique=True))
def test_distinct_ids_give_distinct_stems(agent_ids: list[str]) -> None:
    assert len({agent_file_stem(a) for a in agent_ids}) == len(agent_ids)


# Fragments that path handling trips over, mixed with arbitrary text.
FRAGMENTS = ["../", "..", "/", "\\", "\x00", ".", "~", "-", "\r\n", "C:", "%2e", "\u202e", "\ud800"]
hostile_ids = st.lists(st.sampled_from(FRAGMENTS) | st.text(), min_size=1, max_size=6).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(hostile_ids, min_size=1, max_size=8, unique=True))
def test_any_ids_map_to_distinct_files_directly_inside_the_directory(agent_ids: list[str]) -> None:
    directory = Path("/srv/semantic/agents/model")
    paths = [cache_file_path(directory, a) for a in agent_ids]
    paths += [ConversationStore(directory)._path(a) for a in agent_ids]
    for path in paths:
        assert path.parent == directory and ".." not in path.parts
        assert os.path.normpath(path) == str(path) and "\x00" not in str(path)
    assert len(set(paths)) == len(paths)


def test_hostile_ids_are_written_inside_the_directory_only(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "conversations"
    store = ConversationStore(directory)
    for agent_id in HOSTILE_IDS:
        store.create(agent_id, None, None)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) == len(HOSTILE_IDS) and all(p.parent == directory for p in written)
    assert all(store.get(agent_id).agent_id == agent_id for agent_id in HOSTILE_IDS)
