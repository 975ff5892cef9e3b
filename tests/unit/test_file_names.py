"""Agent ids to file name stems: safe for any id, distinct for distinct ids."""

from __future__ import annotations

import re

from hypothesis import given, settings, strategies as st

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
