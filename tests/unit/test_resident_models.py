"""The resident set's budget (engine/resident_models.py) with stand-in engines: who is unloaded, who never is."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from engine.domain.event_log import EventLog
from engine.errors import ModelsBudgetError
from engine.domain.model_slots import ModelRoutes, ModelSlot, model_slots
from engine.resident_models import ResidentModels

MIB = 2**20


class StandIn:
    """What the resident set reads of an engine: identity, pool bytes, turns in flight, stop."""

    def __init__(self, name: str, pool_mb: int = 10) -> None:
        self.loaded = SimpleNamespace(model_id=name, identity=SimpleNamespace(key=f"{name}@0"), model=None)
        self.pool = SimpleNamespace(total_bytes=pool_mb * MIB, used_bytes=0)
        self.settings = SimpleNamespace(cache=SimpleNamespace(pool_budget_bytes=pool_mb * MIB))
        self.turns_in_flight = 0
        self.is_running = True
        self.device_turns = None
        self.stopped = False

    def stop(self, grace_s: float) -> None:
        self.stopped, self.is_running = True, False

    def snapshot(self):
        return SimpleNamespace(pool=None, agents=(), throughput=SimpleNamespace(active_requests=self.turns_in_flight))


def resident_set(extra: tuple[str, ...], budget_mb: int, loads: list[str] | None = None, slow_s: float = 0.0):
    default = StandIn("main")
    routes = ModelRoutes.of(model_slots("main", extra), ())
    built: dict[str, StandIn] = {}

    def build(slot: ModelSlot) -> StandIn:
        time.sleep(slow_s)
        if loads is not None:
            loads.append(slot.alias)
        built[slot.alias] = StandIn(slot.alias)
        return built[slot.alias]

    models = ResidentModels(routes, budget_mb * MIB, build, lambda: default, EventLog(), 0.0)  # type: ignore[arg-type]
    return models, built


def states(models: ResidentModels) -> dict[str, str]:
    return {row["alias"]: row["state"] for row in models.describe()}  # type: ignore[misc]


def test_the_least_recently_used_idle_model_makes_room_and_a_busy_or_pinned_one_never_does() -> None:
    # Each pool is 10 MiB (weights 0 here): the default and two extras fit in 35 MiB, three extras do not.
    models, built = resident_set(("a=a", "b=b", "c=c,pinned"), 35)
    for alias in ("a", "b"):
        models.engine_for(alias)
        models.release_lease(f"{alias}@0")
    models.engine_for("a")  # a used after b: b is the least recently used
    models.release_lease("a@0")
    models.engine_for("c")
    models.release_lease("c@0")
    assert states(models) == {"main": "resident", "a": "resident", "b": "unloaded", "c": "resident"}
    assert built["b"].stopped
    # a has a turn in flight and c is pinned: nothing may go for b, and the refusal says what is resident.
    built["a"].turns_in_flight = 1
    with pytest.raises(ModelsBudgetError, match=r"model b needs about 10 MiB .*serving a turn.* resident: main 10 MiB, a 10 MiB, c 10 MiB"):
        models.engine_for("b")
    assert states(models)["b"] == "unloaded"
    built["a"].turns_in_flight = 0
    models.engine_for("b")
    assert states(models) == {"main": "resident", "a": "unloaded", "b": "resident", "c": "resident"}
    assert models.budget() == {"budget_bytes": 35 * MIB, "held_bytes": 30 * MIB}


def test_a_routed_request_holds_its_model_until_its_turn_is_queued() -> None:
    models, _ = resident_set(("a=a", "b=b"), 25)
    models.engine_for("a")  # leased: its request is being rendered
    with pytest.raises(ModelsBudgetError):
        models.engine_for("b")
    models.release_lease("a@0")
    models.engine_for("b")
    assert states(models)["a"] == "unloaded"


def test_requests_for_a_model_that_is_loading_wait_for_that_one_load() -> None:
    loads: list[str] = []
    models, _ = resident_set(("a=a",), 100, loads, slow_s=0.2)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(models.engine_for("a"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert loads == ["a"] and len(got) == 4 and len({id(e) for e in got}) == 1


def test_a_model_too_big_for_the_budget_beside_the_pinned_ones_says_so() -> None:
    models, _ = resident_set(("a=a,pinned", "big=b,pool=40"), 45)
    models.engine_for("a", request=False)
    with pytest.raises(ModelsBudgetError, match="does not fit even beside the default and pinned models alone"):
        models.engine_for("big")
    assert [row["requests_routed"] for row in models.describe() if row["alias"] == "a"] == [0]  # a load, not a request


def test_a_model_pinned_at_run_time_stays_and_unpinned_it_makes_room_again() -> None:
    models, built = resident_set(("a=a", "b=b"), 25)
    models.engine_for("a")
    models.release_lease("a@0")
    models.set_pinned("a", True)
    assert next(r for r in models.describe() if r["alias"] == "a")["pinned"] is True
    with pytest.raises(ModelsBudgetError, match="pinned"):
        models.engine_for("b")
    assert states(models)["a"] == "resident" and not built["a"].stopped
    models.set_pinned("a", False)
    models.engine_for("b")
    assert states(models) == {"main": "resident", "a": "unloaded", "b": "resident"}
