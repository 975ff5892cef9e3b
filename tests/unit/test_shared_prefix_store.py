"""Shared prefixes on disk (tiny models): written once, read by later agents after eviction and restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.runtime.tiers.accounting import held_bytes
from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.cache_file import read_header
from engine.store.prefix_store import block_keys, prefix_key
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.byte_tokenizer import BOS, EOS
from tests.support.reference import reference_greedy
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_engine_batching import without_eos

pytestmark = pytest.mark.unit

BLOCK = 16
SYSTEM = (BOS, *b"You are one agent of a fleet. Rules: be brief, cite files, run the tests first. " * 2)
HINT = len(SYSTEM)  # the rendered system prompt: where sessions part ways
STORED = HINT // BLOCK * BLOCK


def engine_on(directory: Path, kind: str) -> Engine:
    loaded = loaded_tiny(kind)
    store = WarmStore(directory, stored_model(loaded), 1 << 30, EventLog())
    engine = Engine(loaded, engine_settings(64 << 20, 8, 32), store=store)
    engine.start()
    return engine


def flush(engine: Engine) -> None:
    engine.call(lambda e: e._store.flush()).result()


def ask(engine: Engine, agent: str, task: bytes, max_tokens: int = 6):
    prompt = SYSTEM + tuple(task)
    result = run_turn(engine, GenerationRequest(agent, prompt, max_tokens, prefix_hint=HINT))
    expected = reference_greedy(engine.loaded.model, list(prompt), max_tokens, {EOS})
    assert result.tokens == without_eos(expected), agent
    return result.finish.usage


def test_block_keys_are_stable_chained_and_name_whole_blocks() -> None:
    tokens = list(range(40))
    keys = block_keys(tokens, BLOCK)
    assert len(keys) == 2 and keys == block_keys(tokens[:32] + [999], BLOCK)
    assert block_keys([0] + tokens[1:], BLOCK) == keys  # same ids, same keys
    assert block_keys([5] + tokens[1:], BLOCK)[1] != keys[1]  # a change early changes every later key
    assert prefix_key(tokens[:32], BLOCK) == keys[1]
    with pytest.raises(ValueError):
        prefix_key(tokens[:33], BLOCK)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_a_later_agent_reads_the_prefix_after_the_first_was_deleted_and_after_a_restart(
    tmp_path: Path, kind: str,
) -> None:
    engine = engine_on(tmp_path, kind)
    try:
        first = ask(engine, "first", b"Task one: list the files.")
        assert first.reused_tokens == 0
        flush(engine)
        snap = engine.fresh_snapshot()
        assert snap.tiers.prefix_files == 1 and snap.tiers.prefix_bytes > 0
        engine.call(lambda e: e.ops.delete_agent("first")).result()  # gone from memory and disk
        second = ask(engine, "second", b"Task two: fix the bug.")
        assert second.reuse_source.startswith("prefix:") and second.reused_tokens == STORED
        held, counted = engine.call(lambda e: (held_bytes(e.agents), e.pool.used_bytes)).result()
        assert held == counted
    finally:
        engine.stop()
    restarted = engine_on(tmp_path, kind)
    try:
        third = ask(restarted, "third", b"Task three: write the docs.")
        assert third.reuse_source.startswith("prefix:") and third.reused_tokens == STORED
    finally:
        restarted.stop()


def test_a_prompt_that_differs_inside_the_prefix_does_not_use_it(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, "llama")
    try:
        ask(engine, "first", b"Task one.")
        flush(engine)
        engine.call(lambda e: e.ops.evict_agent("first", Tier.COLD)).result()
        other = (BOS, *b"A different system prompt entirely, long enough to fill several blocks of tokens.")
        result = run_turn(engine, GenerationRequest("other", other + tuple(b" go"), 4, prefix_hint=len(other)))
        assert result.finish.usage.reused_tokens == 0
    finally:
        engine.stop()


def test_a_corrupt_prefix_file_is_quarantined_and_the_turn_prefills(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, "gemma")
    try:
        ask(engine, "first", b"Task one.")
        flush(engine)
        directory = engine.call(lambda e: e._store.prefixes.directory).result()
        engine.call(lambda e: e.ops.delete_agent("first")).result()
    finally:
        engine.stop()
    (path,) = directory.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = engine_on(tmp_path, "gemma")
    try:
        usage = ask(restarted, "second", b"Task two.")
        assert usage.reused_tokens == 0  # the read failed its checksum: prefilled, not served garbage
        assert any("quarantine" in str(p) for p in directory.rglob("*"))
    finally:
        restarted.stop()


def test_an_agent_file_references_the_stored_prefix_instead_of_repeating_it(tmp_path: Path) -> None:
    engine = engine_on(tmp_path, "gemma")
    try:
        ask(engine, "writer", b"Task one.")
        flush(engine)
        long_task = b"Task two, with a long description of what to change and why. " * 3
        ask(engine, "reader", long_task)  # starts from the stored prefix
        engine.call(lambda e: e.ops.evict_agent("reader", Tier.WARM)).result()
        flush(engine)
        header = engine.call(lambda e: read_header(e._store.entries["reader"].path)).result()
        assert header.prefix == {"key": prefix_key(list(SYSTEM[:STORED]), BLOCK), "n_tokens": STORED}
        # Restored from the two files, the cache continues exactly as a fresh prefill would.
        follow = SYSTEM + tuple(long_task) + tuple(b" And then?")
        result = run_turn(engine, GenerationRequest("reader", follow, 6, prefix_hint=HINT))
        assert result.finish.usage.reused_tokens >= len(SYSTEM) + len(long_task)
        assert result.tokens == without_eos(reference_greedy(engine.loaded.model, list(follow), 6, {EOS}))
        # The prefix file stays while an agent file leans on it, even past the disk budget.
        referenced = engine.call(lambda e: e._store.referenced_prefixes()).result()
        assert referenced == {header.prefix["key"]}
    finally:
        engine.stop()
