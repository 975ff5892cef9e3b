"""The warm (disk) tier on tiny models: eviction, restore, restart, failures."""

from __future__ import annotations

import shutil

import os
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.domain.event_log import EventKind, EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.byte_tokenizer import EOS
from tests.support.reference import reference_greedy
from tests.support.tiny_models import loaded_tiny
from tests.unit.test_engine_batching import prompt_for, without_eos


def engine_with_store(root: Path, kind: str = "llama", blocks: int = 64, disk_mb: float = 64, loaded=None) -> Engine:
    loaded = loaded or loaded_tiny(kind)
    events = EventLog()
    store = WarmStore(root, stored_model(loaded), int(disk_mb * 2**20), events)
    config = engine_settings(blocks * loaded.spec.block_bytes, 8, 32)
    engine = Engine(loaded, config, store=store, events=events)
    engine.start()
    return engine


def events_of(engine: Engine, kind: EventKind) -> list[str]:
    return [e.message for e in engine.events.since(0) if e.kind is kind]


def continue_turn(engine: Engine, agent: str, previous, extra: bytes, n: int = 8):
    prompt = previous.request.prompt_tokens + tuple(previous.tokens) + tuple(extra)
    return run_turn(engine, GenerationRequest(agent, prompt, n))


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_evict_to_disk_and_restore_gives_identical_continuation(tmp_path: Path, kind: str) -> None:
    engine = engine_with_store(tmp_path, kind)
    try:
        first = run_turn(engine, GenerationRequest("w", prompt_for(0, 3), 8))
        engine.call(lambda e: e.ops.evict_agent("w", Tier.WARM)).result()
        engine.call(lambda e: e._store.flush()).result()
        snap = engine.fresh_snapshot()
        assert snap.agent("w").tier == "warm" and snap.pool.used_blocks == 0
        second = continue_turn(engine, "w", first, b" go on")
        expected = reference_greedy(engine.loaded.model, list(second.request.prompt_tokens), 8, {EOS})
        assert second.tokens == without_eos(expected)
        assert second.finish.usage.reused_tokens == len(first.request.prompt_tokens) + first.finish.usage.generated_tokens
        assert any("from disk" in m for m in events_of(engine, EventKind.RESTORE))
    finally:
        engine.stop()


def test_restore_before_the_write_finishes_comes_from_memory(tmp_path: Path) -> None:
    engine = engine_with_store(tmp_path)
    try:
        first = run_turn(engine, GenerationRequest("m", prompt_for(1, 2), 6))

        def evict_and_restore(e: Engine) -> str:
            e.ops.evict_agent("m", Tier.WARM)
            state = e.tiers.ensure_hot(e.agents.get("m"))
            return state.value

        assert engine.call(evict_and_restore).result() == "ready"
        assert any("from memory" in m for m in events_of(engine, EventKind.RESTORE))
        second = continue_turn(engine, "m", first, b"!")
        assert second.finish.usage.reuse_source == "self"
    finally:
        engine.stop()


def test_pool_pressure_spills_least_recently_used_agents_to_warm(tmp_path: Path) -> None:
    engine = engine_with_store(tmp_path, blocks=16)
    try:
        turns = [run_turn(engine, GenerationRequest(f"p{i}", prompt_for(i, 4), 8)) for i in range(3)]
        tiers = {a.agent_id: a.tier for a in engine.fresh_snapshot().agents}
        assert tiers["p0"] == "warm" and tiers["p2"] == "hot"
        again = continue_turn(engine, "p0", turns[0], b" again")
        assert again.finish.usage.reused_tokens > 0
        assert again.tokens == without_eos(reference_greedy(engine.loaded.model, list(again.request.prompt_tokens), 8, {EOS}))
    finally:
        engine.stop()


def test_a_restarted_engine_resumes_agents_from_disk(tmp_path: Path) -> None:
    loaded = loaded_tiny("llama")
    a = engine_with_store(tmp_path, loaded=loaded)
    first = run_turn(a, GenerationRequest("r", prompt_for(2, 3), 8))
    a.stop()  # persists hot agents
    b = engine_with_store(tmp_path, loaded=loaded)
    try:
        assert b.fresh_snapshot().agent("r").tier == "warm"
        second = continue_turn(b, "r", first, b" next")
        usage = second.finish.usage
        assert usage.reused_tokens == len(first.request.prompt_tokens) + first.finish.usage.generated_tokens
        assert second.tokens == without_eos(reference_greedy(loaded.model, list(second.request.prompt_tokens), 8, {EOS}))
    finally:
        b.stop()


def test_corrupt_file_is_discarded_and_the_turn_prefills(tmp_path: Path) -> None:
    loaded = loaded_tiny("llama")
    a = engine_with_store(tmp_path, loaded=loaded)
    first = run_turn(a, GenerationRequest("c", prompt_for(0, 3), 6))
    a.stop()
    (path,) = [p for p in tmp_path.rglob("*.safetensors") if "quarantine" not in p.parts]
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    b = engine_with_store(tmp_path, loaded=loaded)
    try:
        second = continue_turn(b, "c", first, b"?", 6)
        assert second.finish.usage.reused_tokens == 0
        assert second.tokens == without_eos(reference_greedy(loaded.model, list(second.request.prompt_tokens), 6, {EOS}))
        discards = events_of(b, EventKind.DISCARD)
        assert any("checksum" in m for m in discards), discards
        assert list(tmp_path.rglob("quarantine/*.safetensors"))
    finally:
        b.stop()


def test_files_of_another_model_are_never_served(tmp_path: Path) -> None:
    a = engine_with_store(tmp_path, loaded=loaded_tiny("llama", seed=1))
    run_turn(a, GenerationRequest("x", prompt_for(0), 4))
    a.stop()
    other = loaded_tiny("llama", seed=2)  # same layout, different weights and identity
    directory = WarmStore(tmp_path, stored_model(other), 1 << 20, EventLog()).directory
    directory.mkdir(parents=True, exist_ok=True)
    for p in tmp_path.rglob("*.safetensors"):
        os.link(p, directory / p.name)
    b = engine_with_store(tmp_path, loaded=other)
    try:
        assert b.fresh_snapshot().agent("x") is None
        assert any("another model" in m for m in events_of(b, EventKind.DISCARD))
    finally:
        b.stop()


def test_disk_budget_turns_the_oldest_warm_agents_cold(tmp_path: Path) -> None:
    engine = engine_with_store(tmp_path, disk_mb=0.1)
    try:
        for i in range(4):
            run_turn(engine, GenerationRequest(f"d{i}", prompt_for(i, 4), 4))
            engine.call(lambda e, i=i: e.ops.evict_agent(f"d{i}", Tier.WARM)).result()
            engine.call(lambda e: e._store.flush()).result()
        engine.call(lambda e: e.tiers.poll()).result()
        snap = engine.fresh_snapshot()
        tiers = {a.agent_id: a.tier for a in snap.agents}
        assert tiers["d0"] == "cold" and tiers["d3"] == "warm", tiers
        assert engine.call(lambda e: e._store.disk_bytes).result() <= 0.1 * 2**20
    finally:
        engine.stop()


def test_an_import_into_a_full_disk_budget_stays_and_the_oldest_other_file_goes(tmp_path: Path) -> None:
    """Found by the crash harness (bench/crash.py): an imported file keeps its exporter's last-used time, so the
    budget dropped it at once as the oldest file, and the import answered 500 with the file gone."""
    engine = engine_with_store(tmp_path)
    try:
        def warm(agent: str) -> Path:
            engine.call(lambda e: e.ops.evict_agent(agent, Tier.WARM)).result()
            engine.call(lambda e: e._store.flush()).result()
            return engine.call(lambda e: e._store.entries[agent].path).result()

        run_turn(engine, GenerationRequest("old", prompt_for(0, 4), 4))
        exported = tmp_path / "exported.bin"
        path = warm("old")
        shutil.copyfile(path, exported)
        for agent in ("b", "c"):
            run_turn(engine, GenerationRequest(agent, prompt_for(1, 4), 4))
            warm(agent)
        # "old" goes cold, its file with it; the budget holds the other two files and no more.
        engine.call(lambda e: e.ops.evict_agent("old", Tier.COLD)).result()
        engine.call(lambda e: e.tiers.poll()).result()
        engine.call(lambda e: e._store.flush()).result()  # (the file is unlinked on the store's I/O thread)
        engine.call(lambda e: setattr(e._store, "disk_budget_bytes", e._store.disk_bytes)).result()
        shutil.copyfile(exported, path)  # the import puts the file in place, then the engine adopts it
        assert engine.call(lambda e: e.ops.adopt_agent(path)).result() == "old"
        engine.call(lambda e: e.tiers.poll()).result()
        tiers = {a.agent_id: a.tier for a in engine.fresh_snapshot().agents}
        assert tiers == {"old": "warm", "b": "cold", "c": "warm"}, tiers
        # A file larger than the whole budget is refused, and not left behind.
        engine.call(lambda e: setattr(e._store, "disk_budget_bytes", 10)).result()
        engine.call(lambda e: e.ops.evict_agent("old", Tier.COLD)).result()
        engine.call(lambda e: e.tiers.poll()).result()
        engine.call(lambda e: e._store.flush()).result()  # (the file is unlinked on the store's I/O thread)
        shutil.copyfile(exported, path)
        with pytest.raises(InvalidRequestError, match="disk budget"):
            engine.call(lambda e: e.ops.adopt_agent(path)).result()
        engine.call(lambda e: e._store.flush()).result()
        assert not path.exists()
    finally:
        engine.stop()


def test_a_restart_over_the_disk_budget_starts_and_turns_the_oldest_cold(tmp_path: Path) -> None:
    """Found by the crash harness: a process killed after a write and before the budget's next pass leaves the
    warm tier over budget; the next start evicted files while indexing them, and failed with a KeyError. And,
    found with swaps in its load: a ready server listed an agent warm whose file the first budget pass then
    deleted. The budget is settled before ready: the first snapshot and the files agree."""
    engine = engine_with_store(tmp_path)
    try:
        for i, agent in enumerate(("a", "b", "c")):
            run_turn(engine, GenerationRequest(agent, prompt_for(i, 4), 4))
            engine.call(lambda e, agent=agent: e.ops.evict_agent(agent, Tier.WARM)).result()
            engine.call(lambda e: e._store.flush()).result()
        two_files = engine.call(lambda e: e._store.disk_bytes - e._store.entries["a"].nbytes).result()
    finally:
        engine.stop()
    again = engine_with_store(tmp_path, disk_mb=two_files / 2**20)
    try:
        at_ready = {a.agent_id: a.tier for a in again.snapshot().agents}  # (published before ready)
        files = {p.name.split("-")[0] for p in tmp_path.rglob("*.safetensors")}
        assert at_ready == {"a": "cold", "b": "warm", "c": "warm"}, at_ready
        assert files == {"b", "c"}, files
        tiers = {a.agent_id: a.tier for a in again.fresh_snapshot().agents}
        assert tiers == at_ready
    finally:
        again.stop()


def test_write_failure_makes_the_agent_cold_and_the_engine_keeps_going(tmp_path: Path) -> None:
    engine = engine_with_store(tmp_path)
    try:
        first = run_turn(engine, GenerationRequest("f", prompt_for(0), 4))
        directory = engine.call(lambda e: e._store.directory).result()
        shutil.rmtree(directory)
        directory.write_text("not a directory")  # every write into it now fails
        engine.call(lambda e: e.ops.evict_agent("f", Tier.WARM)).result()
        engine.call(lambda e: e._store.flush()).result()
        engine.call(lambda e: e.tiers.poll()).result()
        assert engine.fresh_snapshot().agent("f").tier == "cold"
        assert any("could not write" in m for m in events_of(engine, EventKind.DISCARD))
        again = continue_turn(engine, "f", first, b"x", 4)
        assert again.finish.usage.reused_tokens == 0 and again.finish.error is None
    finally:
        engine.stop()


def test_unwritable_cache_directory_disables_the_warm_tier(tmp_path: Path) -> None:
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the directory should be")
    engine = engine_with_store(blocker)
    try:
        assert any("warm tier disabled" in m for m in events_of(engine, EventKind.ERROR))
        run_turn(engine, GenerationRequest("u", prompt_for(0), 4))
        engine.call(lambda e: e.ops.evict_agent("u", Tier.WARM)).result()
        assert engine.fresh_snapshot().agent("u").tier == "cold"
    finally:
        engine.stop()


LEFT_RUNNING = """
import sys
from pathlib import Path
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from tests.unit.test_engine_batching import prompt_for
from tests.unit.test_warm_tier import engine_with_store
engine = engine_with_store(Path(sys.argv[1]))
run_turn(engine, GenerationRequest("left", prompt_for(2, 3), 8))
# The interpreter exits with the engine still running: its atexit stop persists the hot agent after Python
# has stopped every thread pool (found in CI: the write raised, the engine thread died, MLX aborted).
"""


def test_an_engine_left_running_at_exit_still_writes_its_agents(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LEFT_RUNNING, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    engine = engine_with_store(tmp_path)
    try:
        assert engine.fresh_snapshot().agent("left").tier == "warm"
    finally:
        engine.stop()


def test_both_io_executors_pass_keyword_arguments_and_the_thread_runs_inline_once_stopped() -> None:
    from engine.store.warm_store import InlineExecutor, IOThread

    io = IOThread()
    for executor in (InlineExecutor(), io):
        assert executor.submit(lambda a, b=0: a + b, 1, b=2).result(5) == 3
    io.shutdown()
    assert io.submit(lambda a, b=0: a * b, 3, b=4).result(0) == 12
