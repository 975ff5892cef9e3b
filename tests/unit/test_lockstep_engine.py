"""Two engines in lockstep, ranks as threads (tests/support/thread_world.py): rank 0 takes the requests,
rank 1 replays them and must end every step in the same state, cache for cache.

The real two-process runs over MLX's ring backend are in tests/model/test_distributed_real.py.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from engine.distributed.lockstep import Lockstep, LockstepError
from engine.runtime.tiers.agents import Tier
from engine.runtime.engine_thread.engine import Engine
from tests.support.engine_settings import engine_settings
from engine.runtime.engine_thread.engine_ops import EvictAgent
from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest, SamplingParams
from engine.runtime.engine_thread.sync_client import run_turns
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.byte_tokenizer import BOS
from tests.support.thread_world import ThreadHub
from tests.support.tiny_models import loaded_tiny


def start_pair(root: Path, budgets_mb: tuple[float, float] = (16, 16), timeout_s: float = 30) -> list[Engine]:
    """Rank 0 and rank 1 of a "sharded" tiny llama (each holds the whole model; lockstep does not care)."""
    engines = []
    for world, budget in zip(ThreadHub(2, timeout_s).worlds(), budgets_mb):
        loaded = loaded_tiny("llama")
        loaded = replace(loaded, spec=replace(loaded.spec, shard=(world.rank, world.size)))
        store = WarmStore(root, stored_model(loaded), 2**30, EventLog())
        config = engine_settings(int(budget * 2 ** 20), 8, 32)
        engines.append(Engine(loaded, config, store=store, lockstep=Lockstep(world)))
    errors: list[BaseException] = []

    def start(engine: Engine) -> None:
        try:
            engine.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        for engine in engines:
            engine.stop(0)
        raise errors[0]
    return engines


def request(agent: str, text: str, **sampling) -> GenerationRequest:
    return GenerationRequest(agent, (BOS, *text.encode()), 12, SamplingParams(**sampling))


def caches(engine: Engine) -> dict[str, tuple[str, list[int]]]:
    """Every agent's tier and cached tokens, read on the engine thread after its last step."""
    return engine.call(lambda e: {a.agent_id: (a.tier.value, list(a.tokens)) for a in e.agents}).result(10)


def settled(follower: Engine, leader: Engine, timeout_s: float = 10) -> None:
    """Rank 1 replays a tick after rank 0 ran it: wait until it holds what rank 0 holds."""
    deadline = time.monotonic() + timeout_s
    while caches(follower) != caches(leader) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_follower_replays_turns_evictions_and_restores_cache_for_cache(tmp_path: Path) -> None:
    leader, follower = start_pair(tmp_path)
    try:
        turns = [request(f"a{i}", f"agent {i} says hello " * (i + 1)) for i in range(3)]
        turns.append(request("sampled", "pick any words", temperature=1.0))  # no seed: rank 0 picks one for all
        run_turns(leader, turns)
        settled(follower, leader)
        assert caches(follower) == caches(leader)
        assert all(tier == "hot" and tokens for tier, tokens in caches(leader).values())

        leader.call(EvictAgent("a0", Tier.WARM)).result(10)
        leader.call(EvictAgent("a1", Tier.COLD)).result(10)
        settled(follower, leader)
        assert {a: t for a, (t, _) in caches(follower).items()} == {"a0": "warm", "a1": "cold", "a2": "hot",
                                                                     "sampled": "hot"}
        for rank in (0, 1):
            assert len(list((tmp_path.glob(f"*/rank{rank}-of-2/a0-*.safetensors")))) == 1

        run_turns(leader, [request("a0", "agent 0 says hello and more"), request("a1", "agent 1 again")])
        settled(follower, leader)
        assert caches(follower) == caches(leader)
        assert caches(leader)["a0"][0] == "hot"
        # Rank 0 knows every rank's memory from the last tick, and shows it in its snapshot.
        ranks = leader.fresh_snapshot().ranks
        assert [(r.rank, r.world_size) for r in ranks] == [(0, 2), (1, 2)]
        assert all(r.active_bytes > 0 for r in ranks)
        from engine.api.metrics import SnapshotCollector
        from engine.api.service import EngineService
        from engine.settings import Settings

        service = EngineService(Settings(), None)
        service.attach(leader)
        families = {f.name: f for f in SnapshotCollector(service).collect()}
        samples = {s.labels["rank"]: s.value for s in families["semantic_rank_memory_bytes"].samples}
        assert set(samples) == {"0", "1"} and all(v > 0 for v in samples.values())
    finally:
        leader.stop(0)
        follower.wait()
    # Rank 0's stop reached rank 1 as its last tick: it ended cleanly and wrote its shards too.
    assert follower.failure is None and leader.failure is None
    for rank in (0, 1):
        names = sorted(p.name.split("-")[0] for p in tmp_path.glob(f"*/rank{rank}-of-2/*.safetensors"))
        assert names == ["a0", "a1", "a2", "sampled"], (rank, names)


def test_a_change_made_on_one_rank_alone_is_caught_as_divergence_and_stops_both(tmp_path: Path) -> None:
    leader, follower = start_pair(tmp_path, timeout_s=5)
    try:
        run_turns(leader, [request("a0", "hello there")])
        settled(follower, leader)
        # A plain function is this rank's business only; one that changes state breaks the lockstep.
        follower.call(lambda e: e.ops.evict_agent("a0", Tier.COLD)).result(10)
        run_turns(leader, [request("a1", "another agent")])
        follower.wait()
        deadline = time.monotonic() + 20
        while leader.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        leader.stop(0)
        follower.stop(0)
    # Every rank sees every rank's digest, so both stop at the same tick with the same message.
    for engine in (leader, follower):
        assert isinstance(engine.failure, LockstepError), engine.failure
        assert "rank 1 diverged from rank 0" in str(engine.failure)


def test_ranks_whose_settings_differ_refuse_to_start_naming_the_difference(tmp_path: Path) -> None:
    with pytest.raises(LockstepError, match="differs between ranks"):
        start_pair(tmp_path, budgets_mb=(16, 8))


def test_the_pool_map_names_each_rank_and_its_memory_above_the_blocks() -> None:
    from engine.domain.block_pool import PoolSnapshot
    from semantic_tui.widgets.pool_map import PoolView, render_pool

    pool = PoolSnapshot(total_blocks=4, used_blocks=2, block_bytes=1024, n_groups=1, shared_blocks=0,
                        owner_blocks={"a": 2}, block_owner=("a", "a", None, None), block_group=(0, 0, None, None))
    sharded = render_pool(PoolView(pool, frozenset(), (("a", "a"),), ranks=((0, 3 * 2**30), (1, 2**30))), 70, 8)
    assert sharded.plain.splitlines()[0] == "2 ranks, each a shard of every block: r0 3.0 GiB · r1 1.0 GiB"
    alone = render_pool(PoolView(pool, frozenset(), (("a", "a"),)), 70, 8)
    assert "ranks" not in alone.plain


def test_ranks_sharing_a_host_split_its_cores_between_their_blas_threads(tmp_path: Path) -> None:
    from engine.distributed.local_ranks import blas_threads, cores_per_rank, local_ranks
    from engine.platform.openblas import reexec_environ

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.0.0.2:5002"]]')
    env = {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": "1"}
    assert local_ranks(env) == 2 and blas_threads(env, cores=8) == 4
    assert local_ranks({**env, "MLX_RANK": "2"}) == 1 and blas_threads({**env, "MLX_RANK": "2"}, cores=8) is None
    assert blas_threads({**env, "OPENBLAS_NUM_THREADS": "3"}, cores=8) is None  # the user's choice stands
    assert blas_threads({}, cores=8) is None  # not launched
    assert cores_per_rank(env, cores=8) == 4 and cores_per_rank({}, cores=8) == 8 and cores_per_rank(env, cores=1) == 1
    # The re-exec gives numba's team (the decode step's compiled loops) the same share as OpenBLAS.
    shared = reexec_environ(tmp_path / "libblas.so.3", env)
    assert shared["NUMBA_NUM_THREADS"] == shared["OPENBLAS_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert reexec_environ(tmp_path / "libblas.so.3", {**env, "NUMBA_NUM_THREADS": "1"})["NUMBA_NUM_THREADS"] == "1"
    assert "NUMBA_NUM_THREADS" not in reexec_environ(tmp_path / "libblas.so.3", {"MLX_RANK": "0"})
    hostfile.write_text('{"jaccl": true}')
    assert local_ranks(env) == 1


def test_a_message_torn_by_a_dying_peer_reads_as_a_lost_rank() -> None:
    from engine.distributed.world import PeerLostError, World

    world = World(None, 1, 2)
    with pytest.raises(PeerLostError, match="lost the connection to rank 0 .*a message arrived torn"):
        world._unpickle(bytes(16))  # zeros where rank 0's bytes should have been summed in


def test_an_idle_pair_pauses_between_ticks_and_wakes_for_the_next_request(tmp_path: Path) -> None:
    """Idle, rank 0 announces a pause with each tick and rank 1 sleeps it out instead of waiting inside the
    next collective (where MLX's ring backend spins a core); a request after the pause is served as before."""
    from engine.runtime.engine_thread.replica import MAX_PAUSE_S, Replica

    leader, follower = start_pair(tmp_path)
    try:
        run_turns(leader, [request("a0", "hello there")])
        time.sleep(3.0)  # idle long enough for the longest pause (a tenth of the time idle, from 2.5 s)
        replica = follower._ranks
        assert isinstance(replica, Replica) and replica.pause_s == pytest.approx(MAX_PAUSE_S)
        before = replica.lockstep.ticks
        time.sleep(1.0)
        ticks = replica.lockstep.ticks - before
        assert 1 <= ticks <= 1.0 / MAX_PAUSE_S + 1, ticks  # was one every 50 ms (IDLE_WAIT_S) before pauses
        started = time.monotonic()
        run_turns(leader, [request("a0", "hello there, and again")])
        assert time.monotonic() - started < 5
        settled(follower, leader)
        assert caches(follower) == caches(leader)
    finally:
        leader.stop(0)
        follower.wait()
    assert follower.failure is None and leader.failure is None
