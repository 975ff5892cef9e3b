"""The load and soak runs' exact pool check (bench/server_probe.py) counts a shared prefix block in each holder."""

from __future__ import annotations

from bench.server_probe import pool_account


def stats(holders: list[list[str]], cached: dict[str, int]) -> dict:
    used = sum(1 for ids in holders if ids)
    return {
        "pool": {"block_map": {"owners": [ids[0] if ids else None for ids in holders],
                               "groups": [0 if ids else None for ids in holders], "holders": holders},
                 "used_blocks": used, "total_blocks": len(holders), "used_bytes": used * 10,
                 "shared_blocks": sum(1 for ids in holders if len(ids) > 1)},
        "model": {"cache_spec": {"block_tokens": 16, "groups": [{"index": 0, "kind": "global"}]}},
        "agents": [{"agent_id": a, "tier": "hot", "cached_tokens": n, "state": "idle"} for a, n in cached.items()],
        "tiers": {"hot_array_bytes": used * 10, "hot_agents": len(cached), "warm_agents": 0},
        "throughput": {"active_requests": 0, "requests_total": 3},
    }


def test_two_lanes_sharing_their_prefix_block_account_exactly() -> None:
    # "a" and its lane "a-2" share block 0 (16 prompt tokens); each holds one block of its own.
    account = pool_account(stats([["a", "a-2"], ["a"], ["a-2"], []], {"a": 30, "a-2": 28}))
    assert account.problems == () and account.cache_blocks == 3 == account.used_blocks and account.shared_blocks == 1
    # (by id: a soak names the agents that appeared between its idle start and end)
    assert account.hot_tokens == (("a", 30), ("a-2", 28))


def test_an_agent_short_of_blocks_and_a_block_nobody_hot_holds_are_problems() -> None:
    account = pool_account(stats([["a", "a-2"], ["a"], ["gone"]], {"a": 30, "a-2": 28}))
    assert any("a-2: 1 blocks" in p for p in account.problems)
    assert any("'gone', which is not a hot agent" in p for p in account.problems)
    assert account.unaccounted == 1


def test_a_new_lane_is_told_from_another_new_agent_and_its_own_blocks_are_counted_apart() -> None:
    from bench.soak import new_agents

    start = pool_account(stats([["a", "a-2"], ["a"], ["a-2"], []], {"a": 30, "a-2": 28}))
    # "a-3" (a lane of "a", as a client that drops a request and resends at once may get) shares the prefix
    # block and holds one of its own; "z" was not there at all.
    end = pool_account(stats([["a", "a-2", "a-3"], ["a"], ["a-2"], ["a-3"], ["z"]],
                             {"a": 30, "a-2": 28, "a-3": 20, "z": 5}))
    assert new_agents(start, end) == (["a-3"], ["z"])
    assert end.held_only_by({"a-3"}) == 1 and end.held_only_by({"a-3", "z"}) == 2
